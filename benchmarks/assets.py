"""The benchmarks' name for :mod:`kvcache.assets` (real model and real text, offline after one download).

Kept so that ``python benchmarks/assets.py`` still fetches everything once and scripts here can
``import assets``; works from a source tree whose kvcache is not (re)installed yet, too.
"""

import importlib.util
import sys
from pathlib import Path

try:
    from kvcache import assets as _impl
except ImportError:  # an installed kvcache older than this tree: load the module from the source
    _spec = importlib.util.spec_from_file_location(
        "kvcache_assets", Path(__file__).resolve().parents[1] / "python" / "kvcache" / "assets.py")
    _impl = sys.modules["kvcache_assets"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_impl)

if __name__ == "__main__":
    _impl.main()
else:
    sys.modules[__name__] = _impl
