"""Randomness: dropout RNG streams (tracker), recomputation that replays them, layout-independent init.

Dropout streams (Megatron ``tensor_parallel/random.py`` + ``training/initialize.py::_set_random_seed``)::

    base    = seed + 100 * pp_rank                      (+ stream_offset, for re-derivation on resume)
    default = base                       torch's global CPU / CUDA generator: same on every TP and DP
                                         rank of a stage -> masks outside TP regions match across TP
    "model-parallel-rng" = base + 2718 + tp_rank
                                         used inside `RNGStatesTracker.fork()` -> masks inside TP
                                         regions (head-sharded attention probabilities; everything
                                         under sequence parallelism) differ across TP ranks

DP ranks share both streams (as Megatron without ``data_parallel_random_init``). Pipeline stages
are offset by 100 per pp rank (so the model-parallel stream includes the pp offset too, as in
Megatron, where it is derived from the already offset seed). Virtual chunks of one rank share
its streams.

Dropout in a compiled chunk (`mptrain.layers.compile`): swapping a generator's state (`RNGStatesTracker.fork`)
cannot be traced, so inside a compiled region every mask is drawn from torch's current generator (Inductor
draws its per-call seeds from it; its philox then makes the mask on the device, also under CUDA graphs,
whose replays advance the generator), and a mask of a TP region is drawn at the TP-unsplit shape and sliced
to this rank's part (`dropout_slice`): attention-probability masks ``[b, np, s, s]`` sliced to the rank's
heads, hidden masks under sequence parallelism ``[s, b, h]`` sliced to its sequence rows. The semantics
stay Megatron's: masks of a TP region differ across TP ranks (other slices), the others match across TP
ranks, DP ranks share them, all follow ``train.seed`` and the checkpointed generator states. The masks
themselves differ from the eager ones (another generator, another draw order).

Initialisation never touches these streams: every parameter is drawn at its full unpadded
shape from its own ``torch.Generator`` seeded by (seed, the parameter's global name), then
sliced (`ParamInit`), so the full model is the same for every TP/PP layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _state_for_seed(device: torch.device, seed: int) -> torch.Tensor:
    """The generator state of a fresh generator seeded with ``seed`` (global state untouched)."""
    gen = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
    gen.manual_seed(seed)
    return gen.get_state()


class RNGStatesTracker:
    """Named RNG streams swapped into torch's global generator of ``device`` by `fork`.

    Dropout (``F.dropout``, SDPA's ``dropout_p``) draws from torch's global generator of the
    device (the CPU generator on CPU, the CUDA generator of the device on GPU); `fork(name)`
    swaps that generator's state with the named stream for the duration of the block.
    One tracker per process, shared by all model chunks (built by `init_rng_tracker`).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._states: dict = {}
        self._forked: Optional[str] = None

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``. Raises ValueError if it exists."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._states[name] = _state_for_seed(self.device, seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream ``name`` as the device's global generator (no nesting)."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was not added (have {sorted(self._states)})")
        if self._forked is not None:
            raise RuntimeError(f"RNG fork({name!r}) inside fork({self._forked!r})")
        outer = _get_device_state(self.device)
        _set_device_state(self.device, self._states[name])
        self._forked = name
        try:
            yield
        finally:
            self._states[name] = _get_device_state(self.device)
            _set_device_state(self.device, outer)
            self._forked = None

    # --- snapshots (recomputation) and checkpoints -------------------------------------------
    def capture(self) -> dict:
        """Everything dropout could draw from: CPU + device global states and the named streams."""
        snap = {"cpu": torch.get_rng_state(), "named": {k: v.clone() for k, v in self._states.items()}}
        if self.device.type == "cuda":
            snap["device"] = torch.cuda.get_rng_state(self.device)
        return snap

    def restore(self, snap: dict) -> None:
        """Inverse of `capture`."""
        torch.set_rng_state(snap["cpu"])
        if self.device.type == "cuda" and "device" in snap:
            torch.cuda.set_rng_state(snap["device"], self.device)
        self._states = {k: v.clone() for k, v in snap["named"].items()}

    def state_dict(self) -> dict:
        """This rank's RNG state (all tensors on CPU): global CPU / device generators + named streams."""
        return self.capture()

    def load_state_dict(self, state: dict) -> None:
        if self._forked is not None:
            raise RuntimeError("load_state_dict inside fork()")
        self.restore(state)


def init_rng_tracker(seed: int, groups, device: Optional[torch.device] = None, *, stream_offset: int = 0) -> RNGStatesTracker:
    """Seed torch's global generators and build the tracker for this rank (see the module docstring).

    Args:
        seed: ``train.seed``.
        groups: ParallelGroups (tp_rank, pp_rank).
        device: the compute device (default ``groups.device``).
        stream_offset: added to the base seed (for re-deriving streams on a resume whose layout changed).
    Side effect: ``torch.manual_seed(seed + 100 * pp_rank + stream_offset)`` (all devices).
    """
    device = torch.device(device if device is not None else groups.device)
    base = seed + _PP_SEED_STRIDE * groups.pp_rank + stream_offset
    torch.manual_seed(base)
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, base + _TP_SEED_OFFSET + groups.tp_rank)
    return tracker


# --- dropout inside a compiled region ----------------------------------------------------------
def in_compiled_region() -> bool:
    """True while Dynamo traces (``torch.compiler.is_compiling``): dropout is drawn as in the module docstring's
    "Dropout in a compiled chunk", without `RNGStatesTracker.fork`."""
    return torch.compiler.is_compiling()


def dropout_slice(x: torch.Tensor, p: float, *, dim: int, index: int, parts: int) -> torch.Tensor:
    """Dropout of ``x``, the ``index``-th of ``parts`` equal slices along ``dim`` of a tensor: the keep mask is
    drawn at the full shape (``x.shape`` with ``dim`` × ``parts``) from torch's current generator and
    sliced, so each part gets its own mask and every rank holding the part gets the same one.

    Every layout draws the same full mask (one ``rand`` of the full shape per dropout site, in the same
    order), so a compiled chunk's masks do not depend on tp or sequence parallelism.

    Args:
        x: any shape.
        p: drop probability in [0, 1).
        dim, index, parts: where ``x`` sits in the full tensor (e.g. heads: dim 1, the TP rank, tp; 1 part:
            the whole tensor).
    Returns:
        ``x · keep / (1 - p)`` in ``x``'s dtype, keep ~ Bernoulli(1 - p) (torch's ``native_dropout``
        decomposition: ``rand > p``). In a compiled graph Inductor fuses the draw into the consumer and
        generates only the sliced elements.
    """
    full = list(x.shape)
    full[dim] *= parts
    n = x.shape[dim]
    keep = torch.rand(full, device=x.device, dtype=torch.float32).narrow(dim, index * n, n) > p  # this part's mask
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


# --- recomputation ------------------------------------------------------------------------------
class _CheckpointFunction(torch.autograd.Function):
    """Run ``fn`` without saving activations; in backward, restore the RNG snapshot and re-run it.

    (Megatron ``tensor_parallel/random.py::CheckpointFunction``.) The snapshot covers torch's
    global generators and every tracker stream, so dropout masks are replayed bit for bit,
    also inside and across `RNGStatesTracker.fork` blocks.
    """

    @staticmethod
    def forward(ctx, fn, tracker, n_args, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.snapshot = tracker.capture()
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.requires = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.non_tensors = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            out = fn(*args)
        ctx.single = torch.is_tensor(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = []
        for is_t, req, nt in zip(ctx.is_tensor, ctx.requires, ctx.non_tensors):
            if is_t:
                t = next(saved).detach()
                t.requires_grad_(req)
                args.append(t)
            else:
                args.append(nt)
        now = ctx.tracker.capture()
        ctx.tracker.restore(ctx.snapshot)
        try:
            with torch.enable_grad():
                out = ctx.fn(*args)
        finally:
            ctx.tracker.restore(now)
        outs = (out,) if ctx.single else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = tuple(a.grad if torch.is_tensor(a) and r else None for a, r in zip(args, ctx.requires))
        return (None, None, None) + arg_grads


def checkpoint(fn: Callable, tracker: RNGStatesTracker, *args):
    """``fn(*args)`` with activation recomputation in backward (same dropout masks).

    In a compiled region (`in_compiled_region`) the tracker's host-side snapshot cannot be traced; there it is
    torch's non-reentrant ``torch.utils.checkpoint.checkpoint``, which Dynamo turns into a recomputed region
    of the graph, recomputed in the backward graph by AOTAutograd's partitioner, which saves the generator state
    before a recomputed random op and replays it, so the recomputation repeats the forward's masks (checked on
    CPU by tests/test_model_dropout.py; on CUDA by tests/test_gpu_compile_chunk.py, against central differences
    of the loss). Those masks differ from the plain graph's (there Inductor draws them in its own kernels).

    Args:
        fn: a function of tensors (and non-tensor values); returns a tensor or a tuple of tensors.
        tracker: the rank's RNG tracker (its snapshot is taken before the forward).
    """
    if in_compiled_region():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return _CheckpointFunction.apply(fn, tracker, len(args), *args)


# --- layout-independent initialisation ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamInit:
    """Draws full, unpadded parameter tensors from (seed, global parameter name).

    Attributes:
        seed: ``train.seed``.
        std: ``model.init_method_std``.
        num_layers: total layers, for the scaled init std / sqrt(2 L) of output projections
            (Megatron ``scaled_init_method_normal``; GPT-2 paper §2.3).
        device: where the generator runs (CPU and CUDA draw different numbers; the full model is
            layout-independent for one device type).
    """

    seed: int
    std: float
    num_layers: int
    device: torch.device = torch.device("cpu")

    def generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(device=self.device) if self.device.type == "cuda" else torch.Generator()
        gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        return gen

    def normal(self, name: str, shape: tuple, *, scaled: bool = False) -> torch.Tensor:
        """fp32 N(0, std²) (or N(0, (std/sqrt(2L))²) when ``scaled``) of the full ``shape``."""
        std = self.std / (2.0 * self.num_layers) ** 0.5 if scaled else self.std
        out = torch.empty(shape, dtype=torch.float32, device=self.device)
        return out.normal_(0.0, std, generator=self.generator(name))
