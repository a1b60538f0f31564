"""The profiler window: Megatron's ``--profile`` with ``--profile-step-start`` / ``--profile-step-end`` /
``--profile-ranks`` / ``--use-pytorch-profiler`` (``train.profile*``, ``train.use_pytorch_profiler``).

Megatron's ``train`` (megatron/training/training.py) starts the profiler at the top of the loop when
``iteration == profile_step_start`` (iterations done so far) and stops it after the step that makes
``iteration == profile_step_end``: with start 10 and end 12 it profiles the 11th and 12th steps. mptrain
numbers an iteration by the steps completed (DESIGN.md §2), so the window is iterations start + 1 .. end,
the same steps. On a resume past start the window does not open (as Megatron's nsys path).

Two captures, as Megatron's:
- `TorchCapture` (``train.use_pytorch_profiler=true``, and always on CPU, where there is no CUDA capture):
  ``torch.profiler.profile`` with Megatron's options (``record_shapes``, ``with_stack``), one
  ``ProfilerStep#N`` annotation per iteration N, and at the end a Chrome trace
  ``rank<R>.iter<A>-<B>.pt.trace.json`` in logger.tensorboard_dir (Megatron's ``tensorboard_trace_handler``
  folder) or in the run folder when that is null.
- `CudaCapture` (otherwise on CUDA): ``torch.cuda.profiler.start`` / ``stop`` (cudaProfilerStart / Stop,
  the capture range of ``nsys profile --capture-range=cudaProfilerApi``) with ``emit_nvtx`` ranges per op.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Protocol

import torch

from mptrain.errors import ConfigError


def check_profile_config(train, world_size: int) -> None:
    """The ``train.profile*`` keys (pure; `mptrain.training.validate.derive_layout` calls it before any
    collective).

    Raises:
        ConfigError: use_pytorch_profiler without profile; with profile: profile_step_start < 0,
            profile_step_end <= profile_step_start, no rank, or a rank outside [0, world_size).
    """
    if not train.profile:
        if train.use_pytorch_profiler:
            raise ConfigError("train.use_pytorch_profiler=true has no effect without train.profile=true; set it, "
                              "or train.use_pytorch_profiler=false")
        return
    start, end = train.profile_step_start, train.profile_step_end
    if start < 0:
        raise ConfigError(f"train.profile_step_start={start} must be >= 0 (the iterations done before the profiler "
                          "starts)")
    if end <= start:
        raise ConfigError(f"train.profile_step_end={end} must be > train.profile_step_start={start}: the profiler "
                          f"records iterations start + 1 .. end; set train.profile_step_end={start + 2}")
    ranks = list(train.profile_ranks)
    outside = [r for r in ranks if not 0 <= r < world_size]
    if not ranks or outside:
        raise ConfigError(f"train.profile_ranks={ranks} must list global ranks in [0, {world_size}) (world size "
                          f"{world_size}); e.g. train.profile_ranks=[0]")


class Capture(Protocol):
    """What the window drives: `start` before iteration ``iteration`` runs, `step` before each later one in
    the window, `stop` after the last; `stop` returns where the trace went (None: an outer profiler's)."""

    def start(self, iteration: int) -> None: ...

    def step(self, iteration: int) -> None: ...

    def stop(self) -> Optional[Path]: ...


def _record_always(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


class TorchCapture:
    """``torch.profiler.profile`` over the window (CPU activity, plus CUDA on a GPU), written as a Chrome
    trace into ``trace_dir`` on `stop`.

    Args:
        trace_dir: the folder of the trace (created on `stop`).
        rank: global rank (in the file name).
        device: the run's device (CUDA activity recorded on a GPU).
    """

    def __init__(self, trace_dir: Path, *, rank: int, device: torch.device) -> None:
        self.trace_dir, self.rank, self.device = Path(trace_dir), rank, torch.device(device)
        self._prof: Optional[torch.profiler.profile] = None
        self._first = self._last = 0

    def start(self, iteration: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # a schedule (recording at every step: the window decides when) is what makes torch annotate the steps
        self._prof = torch.profiler.profile(activities=activities, schedule=_record_always, record_shapes=True,
                                            with_stack=True)
        self._prof.step_num = iteration  # ProfilerStep#N names the iteration N that runs in it
        self._first = self._last = iteration
        self._prof.start()

    def step(self, iteration: int) -> None:
        self._prof.step()  # closes ProfilerStep#(N-1), opens ProfilerStep#N
        self._last = iteration

    def stop(self) -> Optional[Path]:
        prof, self._prof = self._prof, None
        prof.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        # *.pt.trace.json: the name TensorBoard's profiler plugin looks for (as tensorboard_trace_handler's)
        path = self.trace_dir / f"rank{self.rank}.iter{self._first}-{self._last}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        return path


class CudaCapture:
    """cudaProfilerStart / Stop around the window (an outer ``nsys profile --capture-range=cudaProfilerApi``
    records it), with ``torch.autograd.profiler.emit_nvtx`` ranges per op, as Megatron's."""

    def __init__(self) -> None:
        self._nvtx = None

    def start(self, iteration: int) -> None:
        torch.cuda.profiler.start()
        self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        self._nvtx.__enter__()

    def step(self, iteration: int) -> None:
        pass

    def stop(self) -> Optional[Path]:
        self._nvtx.__exit__(None, None, None)
        self._nvtx = None
        torch.cuda.synchronize()  # host sync, once: the window's kernels finish inside the capture range
        torch.cuda.profiler.stop()
        return None


@dataclasses.dataclass
class ProfilerWindow:
    """Runs a `Capture` over iterations ``start + 1 .. end`` (the loop calls `before_step` / `after_step`
    with the iteration that runs, numbered from 1, and `close` at the end); ``capture`` None: nothing.

    Attributes:
        start, end: ``train.profile_step_start`` / ``train.profile_step_end``.
        capture: this rank's capture, None when this rank does not profile.
    """

    start: int
    end: int
    capture: Optional[Capture] = None
    active: bool = False
    trace: Optional[Path] = None

    def before_step(self, iteration: int) -> None:
        if self.capture is None:
            return
        if iteration == self.start + 1:
            self.capture.start(iteration)
            self.active = True
        elif self.active:
            self.capture.step(iteration)

    def after_step(self, iteration: int) -> None:
        if self.active and iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Stop the capture if it runs (the window's end, or a run that ends or fails inside it)."""
        if self.active:
            self.active = False
            self.trace = self.capture.stop()


def trace_dir(cfg, run_dir: Path) -> Path:
    """Where `TorchCapture` writes: logger.tensorboard_dir (against the working directory, as the TensorBoard
    logger's), else the run folder."""
    tensorboard_dir = cfg.logger.tensorboard_dir
    return Path(tensorboard_dir).absolute() if tensorboard_dir is not None else Path(run_dir)


def uses_torch_profiler(cfg, device: torch.device) -> bool:
    """torch.profiler with use_pytorch_profiler, and on any device but CUDA (no CUDA capture there)."""
    return bool(cfg.train.use_pytorch_profiler) or torch.device(device).type != "cuda"


def profiler_window(cfg, *, rank: int, device: torch.device, run_dir: Path) -> ProfilerWindow:
    """This rank's window for ``train.profile*`` (no capture when profile is off or the rank is not listed)."""
    t = cfg.train
    window = ProfilerWindow(start=t.profile_step_start, end=t.profile_step_end)
    if not t.profile or rank not in list(t.profile_ranks):
        return window
    window.capture = (TorchCapture(trace_dir(cfg, run_dir), rank=rank, device=device) if uses_torch_profiler(cfg, device)
                      else CudaCapture())
    return window


def profile_plan(cfg, *, device: torch.device, run_dir: Path, start_iteration: int) -> Optional[str]:
    """The start-up line saying what the window records (None when train.profile is off)."""
    t = cfg.train
    if not t.profile:
        return None
    first, last = t.profile_step_start + 1, t.profile_step_end
    how = (f"torch.profiler, traces in {trace_dir(cfg, run_dir)}" if uses_torch_profiler(cfg, device)
           else "cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi")
    line = f"profile: iterations {first}-{last} on ranks {list(t.profile_ranks)} with {how}"
    if start_iteration >= first or t.train_iters < first:
        line += (f"; this run trains iterations {start_iteration + 1}-{t.train_iters}, so the window does not open "
                 "(set train.profile_step_start / train.profile_step_end inside it)")
    return line
