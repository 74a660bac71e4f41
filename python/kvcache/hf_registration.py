"""Registration of the ``"kvcache"`` attention and mask functions with transformers: on import of kvcache if
transformers is loaded, else right after ``transformers.modeling_utils`` is imported (an import hook), so
``import kvcache`` does not pay for importing transformers."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from .hf_attention import kvcache_attention, kvcache_mask
from .hf_cache import ATTENTION_NAME

__all__ = ["register_attention", "install_registration"]

_registered = False


def register_attention() -> None:
    """Registers ``"kvcache"`` with transformers' attention and mask interfaces (done on import of
    kvcache once transformers is imported)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvcache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvcache_mask)
    _registered = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the attention implementation right after ``transformers.modeling_utils`` is imported,
    so ``import kvcache`` does not pay for importing transformers."""

    target = "transformers.modeling_utils"

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                register_attention()
            finally:
                if self in sys.meta_path:
                    sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


def install_registration() -> None:
    if "transformers.modeling_utils" in sys.modules:
        register_attention()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
