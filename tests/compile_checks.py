"""What a compiled TP model may not trace: torch.distributed's in-place collectives.

Under ``torch.compile`` the TP collectives must be the functional ones (`mptrain.layers.mappings`): on NCCL,
Dynamo's rewrite of the in-place ones (``dist.all_reduce`` ...) gave wrong weight grads
(bench/reports/2026-11-30-compile-tp-correctness.md) where gloo gave right ones, so equality with an eager run
on gloo alone cannot catch them. `record_traced_collectives` names every in-place collective called while
compiling (tests/test_bench_compile.py, tests/test_grad_accumulation.py).
"""

import contextlib

import torch

IN_PLACE_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


@contextlib.contextmanager
def record_traced_collectives(traced: list):
    """Wrap torch.distributed's in-place collectives; a call made while compiling appends its name to ``traced``."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in IN_PLACE_COLLECTIVES}

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling():
                traced.append(name)
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield traced
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
