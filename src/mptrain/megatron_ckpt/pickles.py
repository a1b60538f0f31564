"""Megatron-LM's pickled files (``common.pt``, ``model_optim_rng.pt``) read without megatron-core.

They are ``torch.save`` pickles that name Megatron's own classes beside tensors and plain values: the ``args``
Namespace holds megatron-core enums (``AttnBackend.auto``), the optimizer state its classes. `load_pickle`
unpickles with an allow-list: tensors and storages (torch's own rebuild functions), ``argparse.Namespace``,
``OrderedDict``, torch dtypes and sizes, NumPy arrays (the RNG states); any other global becomes an `Opaque`
stand-in that records its dotted name and calls nothing. So no module is imported and no function runs
that the file names (``torch.load(weights_only=False)`` would import megatron and call what the pickle
says), and the values mptrain reads (numbers, strings, tensors) come back as they are.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import types
from pathlib import Path

import torch

_ALLOWED = {("argparse", "Namespace"): argparse.Namespace, ("collections", "OrderedDict"): collections.OrderedDict,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
            ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray, ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device}
_NUMPY = {"_reconstruct", "scalar", "ndarray", "dtype"}  # an ndarray's rebuild (np.random.get_state() holds one)


class Opaque:
    """A global of the pickle that is not allowed (a Megatron class, enum or function): its instances keep the
    constructor arguments and state they were given; nothing of the original runs."""

    dotted = "?"

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.dotted}>"


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"dotted": f"{module}.{name}", "__module__": __name__})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return getattr(torch._utils, name)  # tensors and parameters from the file's storages
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "_codecs" and name == "encode":  # protocol 2 spells bytes this way (NumPy's buffers)
            import codecs

            return codecs.encode
        if module.split(".")[0] == "numpy" and name in _NUMPY:
            return super().find_class(module, name)
        return _opaque(module, name)


RESTRICTED = types.ModuleType("mptrain_megatron_pickle")
"""A pickle module for ``torch.load(pickle_module=...)``: `_Unpickler` and ``load``."""
RESTRICTED.Unpickler = _Unpickler
RESTRICTED.load = lambda file, **kw: _Unpickler(file, **kw).load()


def load_pickle(path: Path, *, mmap: bool = True):
    """The object ``torch.save`` wrote to ``path``, through the allow-list (module docstring), tensors on the CPU.

    ``mmap``: tensors stay in the file (torch.load's ``mmap``), read when used, so a checkpoint of many
    ranks is never whole in memory; files of the pre-zip format are read whole.
    """
    load = dict(map_location="cpu", pickle_module=RESTRICTED, weights_only=False)
    try:
        return torch.load(path, mmap=mmap, **load)
    except RuntimeError as err:
        if not mmap or "mmap" not in str(err):
            raise
        return torch.load(path, **load)  # torch.save's legacy (pre-1.6) format cannot be mapped
