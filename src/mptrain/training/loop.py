"""The training loop (Megatron's ``train``; torchtitan's ``Trainer.train``): each iteration runs the step,
then hands every "when" to its owner: the metrics rows (`mptrain.training.metrics.TrainRows`), manual
gc (`mptrain.training.manual_gc.ManualGC`), evaluation (`mptrain.training.evaluation.Evaluator`),
checkpoints and early stops (`mptrain.training.checkpointing.Checkpointer`), the stuck-rank timers
(`mptrain.training.watchdog.LoopWatch`), the profiler window (`mptrain.training.profiler.ProfilerWindow`).
Loop hooks (``built.hooks``: ``before_step(iteration)``, ``before_save(iteration)``) are empty unless a
fault-injection key is set (`mptrain.training.faults`).
"""

from __future__ import annotations

from typing import Any, Optional

from mptrain.training.checkpointing import Checkpointer, Progress
from mptrain.training.evaluation import Evaluator, data_iterators
from mptrain.training.faults import memory_snapshot_of
from mptrain.training.interrupt import interrupt_of
from mptrain.training.manual_gc import ManualGC
from mptrain.training.metrics import TrainRows
from mptrain.training.prefetch import close_prefetchers
from mptrain.training.profiler import ProfilerWindow, profile_plan, profiler_window
from mptrain.training.watchdog import LoopWatch, StepWatchdog, StopSignal


def train(built: Any, recorder: Any, *, stop: StopSignal, heartbeat: Optional[StepWatchdog]) -> dict:
    """Resume, evaluate at iteration 0, run iterations to ``train.train_iters`` (or an early stop), wait
    for the last save, evaluate at the end; returns the job summary (`Recorder.finish`)."""
    cfg = built.cfg
    watch = LoopWatch(built.groups, timeout_s=cfg.train.timeout_s, step_timeout_s=cfg.train.step_timeout_s,
                      stop=stop, heartbeat=heartbeat)
    checkpointer = Checkpointer(built, recorder, stop=stop, untimed=watch.untimed, hooks=built.hooks,
                                start_time=recorder.t_start)
    at = _start(built, recorder, checkpointer)
    start_iteration = at.iteration
    data = data_iterators(built, lambda: built.provider.train_iterator(at.consumed_samples))
    collector = ManualGC(cfg.train.manual_gc, cfg.train.manual_gc_interval, cfg.train.manual_gc_eval)
    evaluator = Evaluator(built, recorder, untimed=watch.untimed, collector=collector)
    evaluator.at_start(at.iteration)
    stop.install()
    rows = TrainRows(recorder, built.trainer, stop)
    g = built.groups
    profiler = profiler_window(cfg, rank=g.rank, device=g.device, run_dir=recorder.run_dir)
    plan = profile_plan(cfg, device=g.device, run_dir=recorder.run_dir, start_iteration=at.iteration)
    if plan is not None:
        recorder.log(plan)
    with memory_snapshot_of(cfg, device=built.groups.device, run_dir=recorder.run_dir, rank=built.groups.rank,
                            log=recorder.log), collector:
        try:
            stopped = _loop(built, data, at, rows=rows, watch=watch, checkpointer=checkpointer, evaluator=evaluator,
                            collector=collector, profiler=profiler)
        finally:
            close_prefetchers(data)  # no batch is read ahead past the last step
            profiler.close()  # a run that ends inside the window still writes what it recorded
    if profiler.trace is not None:
        recorder.log(f"profile: trace written to {profiler.trace}")  # rank 0's, when it profiles
    built.trainer.finish_param_sync()  # parallel.overlap_param_gather: the last step's params, landed
    checkpointer.wait()
    watch.end()  # no more training steps: the final evaluation and the layout gather
    if stopped is None:
        evaluator.at_end(at.iteration, trained=at.iteration > start_iteration)
    result = recorder.finish(built, iteration=at.iteration, stopped=stopped)
    interrupted = (interrupt_of(stop.signum, iteration=at.iteration, save=cfg.checkpoint.save,
                                run_dir=str(recorder.run_dir)) if stopped else None)
    if interrupted is not None:
        raise interrupted  # Ctrl-C: the entry point prints what was saved and exits 130 (training/interrupt.py)
    return result


def _start(built: Any, recorder: Any, checkpointer: Checkpointer) -> Progress:
    """The checkpoint load, then the job's start lines (the kernels that run, the start-up time)."""
    at = checkpointer.resume()
    recorder.start(at.iteration, built)
    train_iters = built.cfg.train.train_iters
    if at.iteration >= train_iters and at.iteration > 0:
        # nothing to train: exit 0 (the job is done), but say so rather than end silently
        recorder.log(f"checkpoint.load={built.cfg.checkpoint.load} is at iteration {at.iteration} >= "
                     f"train.train_iters={train_iters}: nothing to train; raise train.train_iters to continue")
    return at


def _loop(built: Any, data: list, at: Progress, *, rows: TrainRows, watch: LoopWatch, checkpointer: Checkpointer,
          evaluator: Evaluator, collector: ManualGC, profiler: ProfilerWindow) -> Optional[str]:
    """Iterations from ``at`` to ``train.train_iters``; returns why it stopped early ("exit_interval",
    "exit_duration", "signal") or None."""
    cfg, trainer = built.cfg, built.trainer
    while at.iteration < cfg.train.train_iters:
        rows.begin()  # first: the previous iteration's row is written before anything below can stall
        iteration = at.iteration + 1
        watch.arm(iteration)
        for hook in built.hooks:
            hook.before_step(iteration)
        profiler.before_step(iteration)
        with watch.first_step_untimed(iteration), rows.written_on_failure():
            # the iteration's global batch follows the samples consumed before it (a ramp or a step schedule)
            outcome = trainer.train_step(data, consumed_samples=at.consumed_samples)  # settles the previous one
        watch.step_done(iteration)
        profiler.after_step(iteration)  # the window ends with its last step, before an evaluation or a save
        at.advance(outcome.global_batch_size)
        rows.add(at.iteration, at.consumed_samples, outcome)
        collector.after_iteration(at.iteration)  # train.manual_gc: every rank at the same iteration
        stopped = checkpointer.stop_reason(at.iteration)
        evaluating = evaluator.should_evaluate(at.iteration)
        saving = checkpointer.should_save(at.iteration, stopping=stopped is not None)
        if evaluating or saving or stopped or at.iteration == cfg.train.train_iters:
            rows.flush()  # this iteration's row before its evaluation row, its save, the end
        if evaluating:
            evaluator.evaluate("valid", at.iteration)
        if saving:
            checkpointer.save(at)
        if stopped:
            return stopped
    return None
