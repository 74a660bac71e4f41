"""Loads the native extension and turns the usual ways it fails into messages that say what to do."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def _torch_release(version: str) -> str:
    return version.split("+")[0]


def load_extension() -> ModuleType:
    try:
        ext = importlib.import_module("kvcache._C")
    except ImportError as err:  # missing build, or built against another torch (undefined symbols)
        raise ImportError(
            f"kvcache's native extension could not be loaded ({err}). kvcache is compiled against the "
            f"torch of the environment it is installed into; this environment has torch "
            f"{torch.__version__}. Reinstall it here with `pip install --no-build-isolation .` "
            f"from the kvcache source tree."
        ) from err
    built = ext.build_info["torch_version"]
    if _torch_release(built) != _torch_release(torch.__version__):
        raise ImportError(
            f"kvcache was built against torch {built} but torch {torch.__version__} is installed; "
            f"reinstall kvcache with `pip install --no-build-isolation .` in this environment."
        )
    return ext
