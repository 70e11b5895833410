"""Import-only stand-ins for the few heavy modules SGLang 0.5.23 imports at module level but never calls in our tests.

* ``IPython`` / ``IPython.display``: ``sglang.utils`` imports ``HTML`` and ``display`` at import time.
* ``torchvision`` (and any submodule): some SGLang config modules import ``torchvision.transforms`` at import time;
  PyPI's torchvision does not load beside the CPU torch 2.13.0 build CI uses, and the CUDA build it would pull in is
  several GB. Any attribute of a stand-in module is an inert placeholder class; calling into it raises.
* No ``sgl_kernel`` (SGLang's compiled CUDA kernels; the wheel is far too large for the GPU test machine): where CUDA
  is present but ``sgl_kernel`` is not, :func:`hide_cuda_from_sglang` makes SGLang's platform probe
  (``is_cuda()``: ``torch.cuda.is_available() and torch.version.cuda is not None``) answer False, so SGLang takes the
  same code paths as on the CPU machines of CI (Triton and torch, no ``sgl_kernel``) while the tensors, our kernels
  and SGLang's Triton kernels run on the GPU.

Install the stand-ins before the first ``import sglang``. A real installed module always wins: a stand-in is
registered only where the import fails.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_STANDIN_ROOTS = ("torchvision",)


class _PlaceholderMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _PlaceholderMeta(attr, (_Placeholder,), {"__module__": cls.__module__})


class _Placeholder(metaclass=_PlaceholderMeta):
    """Stands for any class, enum or function of a stand-in module; calling it raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("this is an import-only stand-in (tests/sglang/standins.py); it cannot be used")

    def __class_getitem__(cls, item):
        return cls


def _standin_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = f"<specverify stand-in for {name}>"
    mod.__path__ = []  # a package, so submodules import
    mod.__version__ = "0.0.0+standin"
    mod.__specverify_standin__ = True

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        placeholder = type(attr, (_Placeholder,), {"__module__": name})
        setattr(mod, attr, placeholder)
        return placeholder

    mod.__getattr__ = __getattr__
    return mod


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in _STANDIN_ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _standin_module(spec.name)

    def exec_module(self, module):
        return None


def _real_module_importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:
        sys.modules.pop(name, None)
        return False


def hide_cuda_from_sglang() -> bool:
    """On a CUDA machine without ``sgl_kernel``: clear ``torch.version.cuda`` (read by SGLang's ``is_cuda()``; torch's
    CUDA runtime and Triton do not use it) before SGLang is imported. Returns whether it did."""
    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("sgl_kernel") is not None:
        return False
    torch.version.cuda = None
    return True


def install() -> None:
    """Register the stand-ins (idempotent)."""
    if not _real_module_importable("IPython.display"):
        ipython = _standin_module("IPython")
        display = _standin_module("IPython.display")
        display.HTML = type("HTML", (), {"__init__": lambda self, *a, **k: None})
        display.display = lambda *args, **kwargs: None
        ipython.display = display
        sys.modules["IPython"] = ipython
        sys.modules["IPython.display"] = display
    if any(isinstance(f, _StandinFinder) for f in sys.meta_path):
        return
    for root in _STANDIN_ROOTS:
        if root in sys.modules or _real_module_importable(root):
            continue
        sys.meta_path.append(_StandinFinder())
        break


def transformers_sees_no_torchvision() -> None:
    """Tell ``transformers`` that torchvision is not there when only the stand-in is: SGLang's fused-MoE kernels
    import ``sglang.srt.configs``, which imports ``transformers``, which parses torchvision's installed version and
    fails on a module that has none. Test environments only; call it before importing SGLang's MoE kernels."""
    import importlib
    import importlib.metadata

    try:
        importlib.metadata.version("torchvision")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        iu = importlib.import_module("transformers.utils.import_utils")
    except Exception:
        return
    iu.is_torchvision_greater_or_equal = lambda *args, **kwargs: False
