"""Which folder a run writes to, decided before its config resolves (the policy: DESIGN.md §2).

`plan_run_dir` applies the existing-folder policy to the folder the config names (pure: nothing is
created, nothing printed; a refusal raises). `planned_config` then resolves the config with `run.dir`
set to the planned folder, so every `${run.dir}/...` path (the shipped experiment's
`checkpoint.save: ${run.dir}/checkpoints`, a sweep job's `checkpoint.load=${run.dir}/ck`) names that
folder as it resolves: nothing is rewritten afterwards. The folder is created only once the run has
validated and built (`mptrain.runs.claim.claim_run_dir`, which also prints the plan's move line).

A folder holding a run is also resumed in place when this run relaunches it: the same command started
again, its `checkpoint.save` holding a checkpoint (`mptrain.runs.relaunch`); `planned_config` then loads
that checkpoint (`checkpoint.load` = `checkpoint.save`).

Every rank plans alone, before the process group exists: they read the same folders (DESIGN.md §2
asks for one filesystem), and no rank writes into a run folder before every rank has planned (rank 0
claims it after the collectives of the start); `claim_run_dir` checks that the ranks agree.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from mptrain.checkpoint.atomic import checkpoint_exists, list_iterations, read_latest, save_refusal
from mptrain.config.schema import Config, as_config
from mptrain.errors import ConfigError
from mptrain.runs.relaunch import Relaunch, relaunch_of

RUN_FILES = ("config.yaml", "metrics.jsonl", "layout.json", "train.log")
"""The files that make a folder a run folder."""


def default_run_dir(cfg: Any) -> str:
    """`outputs/<model.name>-tp<T>pp<P>[vpp<V>][ep<E>][etp<K>]-<precision.name>` (deterministic: same on every rank
    and rerun).

    The layout part is the degrees the run uses, not the ``parallel=`` option's name: a preset overridden key by
    key (``parallel.tensor_model_parallel_size=2``) names the layout it runs. Unchanged presets spell the same.
    ``cp<C>`` (after tp) appears when context_parallel_size > 1, ``ep<E>`` when expert_model_parallel_size > 1, ``etp<K>`` when expert_tensor_parallel_size is set
    and differs from tp (null means tp)."""
    par = cfg.parallel
    tp, vpp = par.tensor_model_parallel_size, par.virtual_pipeline_model_parallel_size
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    cp = getattr(par, "context_parallel_size", 1)
    layout = (f"tp{tp}" + (f"cp{cp}" if cp > 1 else "") + f"pp{par.pipeline_model_parallel_size}" + (f"vpp{vpp}" if vpp else "")
              + (f"ep{ep}" if ep > 1 else "") + (f"etp{etp}" if etp is not None and etp != tp else ""))
    return f"outputs/{cfg.model.name}-{layout}-{cfg.precision.name}"


def holds_run(path: str | Path) -> bool:
    """`path` is a folder holding a run (one of `RUN_FILES`)."""
    p = Path(path)
    return p.is_dir() and any((p / name).exists() for name in RUN_FILES)


def is_failed_start(path: Path) -> bool:
    """A folder whose only run is a start that failed before its first iteration was recorded.

    config.yaml is written once the run validated and built, but the start can still fail after it
    (a checkpoint of another model, the first step): such a folder has no layout.json and no metrics
    row, holds nothing worth keeping, and the corrected start reuses it (its train.log is appended to).
    """
    names = {e.name for e in path.iterdir()}
    if "config.yaml" not in names or "layout.json" in names or not names <= set(RUN_FILES) | {"config.yaml.tmp"}:
        return False
    metrics = path / "metrics.jsonl"
    return not metrics.exists() or not metrics.read_text().strip()


def run_dir_decision(path: str | Path, *, resuming: bool) -> Optional[str]:
    """The existing-folder policy for `path` (no side effects): None when the run may use it, else the refusal."""
    p = Path(path)
    if not p.exists():
        return None
    if not p.is_dir():
        return f"run.dir={p} exists and is not a folder; pick another run.dir="
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        return None
    run_files = [f for f in RUN_FILES if f in entries]
    if run_files and (resuming or is_failed_start(p)):
        return None
    if run_files:
        return (
            f"run.dir={p} already holds a run ({', '.join(run_files)}) and this run does not resume from a "
            f"checkpoint; pick a new run.dir=, delete the folder, or resume with checkpoint.load="
        )
    return f"run.dir={p} exists, is not empty ({entries[0]}, ...) and is not a run folder; pick an empty or new run.dir="


def path_inside(path: Optional[str], folder: Path) -> bool:
    """`path` (e.g. ``checkpoint.load``) is `folder` or lies under it."""
    if not path:
        return False
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def checkpoint_save_refusal(save: Optional[str], load: Optional[str]) -> Optional[str]:
    """The one-line refusal when `checkpoint.save` already holds checkpoints this run does not resume from.

    A fresh run saving there would move `latest` back to its own iteration (pointing at another
    model) and overwrite that run's `iter_N` folders. Resuming means `checkpoint.load` names the same
    folder (the restart pattern `checkpoint.save=D checkpoint.load=D`). No side effects.

    Args:
        save, load: `checkpoint.save` and `checkpoint.load` (null: not set).
    Returns:
        None when `save` is unset, missing, holds no `latest` nor complete `iter_N`, or is the load folder.
    """
    if not save or (load and Path(load).resolve() == Path(save).resolve()):
        return None
    folder = str(Path(save).resolve())  # `${run.dir}/../ck` before run.dir exists: the folder it will be
    latest, iterations = read_latest(folder), list_iterations(folder)
    if latest is None and not iterations:
        return None
    held = f"latest = iteration {latest}" if latest is not None else f"iterations {iterations[0]} to {iterations[-1]}"
    return (f"checkpoint.save={save} already holds checkpoints ({held}) and this run does not resume from them; "
            f"resume with checkpoint.load={save}, or choose an empty checkpoint.save folder")


def run_dir_from_command_line(overrides: Optional[list] = None) -> bool:
    """`run.dir=` is one of `overrides` (Hydra's task overrides; None: the running app's). Outside a Hydra
    app (a config composed by code) the folder counts as chosen by the caller: True."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return True
        overrides = list(HydraConfig.get().overrides.task)
    return any(str(o).split("=", 1)[0].lstrip("+~") == "run.dir" for o in overrides)


@dataclasses.dataclass(frozen=True)
class RunDirPlan:
    """The folder a run will write to, decided by `plan_run_dir`.

    Attributes:
        dir: the folder, as the config will read it (a relative path stays relative).
        configured: the folder the config named (`run.dir`, the default one, or the sweep job's).
        resuming: the run resumes from a checkpoint of its own folder (an existing run folder is appended to).
        hint: the move line's fix (empty when the run stays in `configured`).
        relaunch: the same run started again in `dir` (`mptrain.runs.relaunch.Relaunch`: it loads
            `checkpoint.save`), or None.
    """

    dir: str
    configured: str
    resuming: bool
    hint: str = ""
    relaunch: Optional[Relaunch] = None

    def finished(self, train_iters: int) -> bool:
        """A relaunch whose checkpoint is at or past `train_iters`: the run is done (nothing to train)."""
        return self.relaunch is not None and self.relaunch.iteration >= train_iters

    @property
    def move_line(self) -> Optional[str]:
        """The stderr line of a run that gave way to `<dir>-N`, or None."""
        if self.dir == self.configured:
            return None
        return f"run.dir: {self.configured} already holds a run; this run writes to {self.dir} ({self.hint})"


def _refuse(refusal: Optional[str]) -> None:
    if refusal is not None:
        err = ConfigError(refusal)
        err.symmetric = True  # every rank reads the same folders: rank 0 alone prints the line
        raise err


def _with(cfg: Any, values: dict) -> Any:
    """A copy of `cfg` (a `DictConfig` or a `Config`) with the dotted keys of `values` set (the caller's is left alone).

    A `DictConfig` that already holds each value itself (`_holds`) is returned as it is: the copy would equal it,
    and what this module does with the result (`_select`, ``resolve``: a new `Config`) leaves it unchanged.
    """
    if isinstance(cfg, DictConfig) and all(_holds(cfg, key, value) for key, value in values.items()):
        return cfg  # start-up time: a deep copy of a composed config is ~7 ms
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        if isinstance(out, DictConfig):
            with open_dict(out):
                OmegaConf.update(out, key, value, force_add=True)
        else:
            *path, leaf = key.split(".")
            node = out
            for name in path:
                node = getattr(node, name)
            setattr(node, leaf, value)
    return out


def _holds(cfg: DictConfig, key: str, value: Any) -> bool:
    """`cfg` has `value` at the dotted `key` as a literal of the same type (not an interpolation, not missing)."""
    *path, leaf = key.split(".")
    parent = OmegaConf.select(cfg, ".".join(path), default=None, throw_on_resolution_failure=False) if path else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent.keys():  # keys(): no interpolation resolved
        return False
    if OmegaConf.is_interpolation(parent, leaf) or OmegaConf.is_missing(parent, leaf):
        return False
    held = parent[leaf]
    return type(held) is type(value) and held == value


def _select(cfg: Any, key: str) -> Any:
    """`cfg`'s value at the dotted `key`, resolved (None where it is unset or does not resolve yet)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    node = cfg
    for name in key.split("."):
        node = getattr(node, name, None)
    return node


def _relaunch(cfg: Any, folder: str, resolve: Callable[[Any], Config]) -> Optional[Relaunch]:
    """`relaunch_of` the run in `folder` for `cfg` resolved there (None: `folder` holds no run, or this run is
    no relaunch: `checkpoint.save` holds no complete checkpoint, `checkpoint.load` names another folder).
    Resolves the config only when `checkpoint.save` holds checkpoints."""
    if not holds_run(folder):
        return None
    here = _with(cfg, {"run.dir": folder})
    save, load = _select(here, "checkpoint.save"), _select(here, "checkpoint.load")
    if not save or not list_iterations(str(save)) or (load and Path(load).resolve() != Path(save).resolve()):
        return None
    # the config the relaunch would run with: it loads its save folder
    return relaunch_of(folder, resolve(_with(here, {"checkpoint.load": load or str(save)})))


def _another_run(refusal: str, relaunch: Optional[Relaunch]) -> str:
    """The refusal of a folder holding a run, saying why a relaunch is not this run's (its config differs)."""
    if relaunch is None:
        return refusal
    return (f"run.dir={relaunch.folder} already holds a run and this run is not its relaunch ({relaunch.difference}); "
            f"resume it anyway with checkpoint.load={relaunch.save}, pick a new run.dir=, or delete the folder")


def plan_run_dir(cfg: Any, *, sweep_job: Any = None, explicit: Optional[bool] = None,
                 resolve: Callable[[Any], Config] = as_config) -> RunDirPlan:
    """The folder this run will write to, by DESIGN.md §2's policy (no side effects).

    Args:
        cfg: the composed config (`DictConfig`, interpolations unresolved) or a `Config`.
        sweep_job: the `mptrain.runs.sweep.SweepJob` in a sweep (its folder is `<root>/<swept keys>`), else None.
        explicit: `run.dir` was given on the command line (such a folder holding a run is refused; one
            the config names gives way to `<dir>-N`); None = `run_dir_from_command_line()`.
        resolve: composed config → `Config`, to compare a relaunch's config with the folder's config.yaml.
    Raises:
        ConfigError (``symmetric``): the folder is refused (`run_dir_decision`).
    """
    if sweep_job is not None:
        folder = str(sweep_job.dir)
        # `checkpoint.load=${run.dir}/ck`: a job resumes from the checkpoints in its own folder
        resuming = checkpoint_exists(_select(_with(cfg, {"run.dir": folder}), "checkpoint.load"))
        relaunch = _relaunch(cfg, folder, resolve)
        same = relaunch if relaunch is not None and relaunch.same_run else None
        refusal = run_dir_decision(folder, resuming=resuming or same is not None)
        _refuse(refusal and _another_run(refusal, relaunch))
        return RunDirPlan(dir=folder, configured=folder, resuming=resuming or same is not None, relaunch=same)
    named = _select(cfg, "run.dir")
    configured = str(named) if named else default_run_dir(cfg)
    explicit = bool(named) and (run_dir_from_command_line() if explicit is None else explicit)
    load = _select(_with(cfg, {"run.dir": configured}), "checkpoint.load")
    # a folder the config named is appended to only by a resume from its own checkpoints, or by a relaunch of
    # its run; resuming from another run's checkpoints is a fresh run there
    resuming = checkpoint_exists(load) and (explicit or path_inside(load, Path(configured)))
    relaunch = _relaunch(cfg, configured, resolve)
    same = relaunch if relaunch is not None and relaunch.same_run else None
    refusal = run_dir_decision(configured, resuming=resuming or same is not None)
    if refusal is None:
        return RunDirPlan(dir=configured, configured=configured, resuming=resuming or same is not None, relaunch=same)
    if explicit or not holds_run(configured):
        _refuse(_another_run(refusal, relaunch))
    moved, own = _next_folder(cfg, configured, resolve, resuming=resuming)
    if relaunch is not None:  # the same save folder, another config: the line says which keys
        hint = relaunch.difference + (f"; {moved} holds this command's run" if own else
                                      f"; resume there anyway with run.dir={configured} checkpoint.load={relaunch.save}")
    elif load:  # a resume from checkpoints outside the config's folder: the fix is the run folder
        hint = "its checkpoint.load lies outside it: add run.dir=<the folder of that run> to append there"
    else:
        hint = "pick the folder with run.dir=, or resume with checkpoint.load="
    return RunDirPlan(dir=moved, configured=configured, resuming=resuming or own is not None, hint=hint, relaunch=own)


def _next_folder(cfg: Any, configured: str, resolve: Callable[[Any], Config], *,
                 resuming: bool) -> tuple[str, Optional[Relaunch]]:
    """The first of `<configured>-2`, `-3`, ... that holds this command's run (its relaunch: the `Relaunch`), or
    else that `run_dir_decision` accepts (None): a command whose config moved it on once finds its run again."""
    path, n = Path(configured), 1
    while True:
        n += 1
        candidate = str(path.with_name(f"{path.name}-{n}"))
        relaunch = _relaunch(cfg, candidate, resolve)
        if relaunch is not None and relaunch.same_run:
            return candidate, relaunch
        if run_dir_decision(candidate, resuming=resuming) is None:
            return candidate, None


def _planned_keys(plan: RunDirPlan) -> dict:
    """What the plan sets in the config: `run.dir`, and for a relaunch the checkpoint it loads."""
    return {"run.dir": plan.dir, **({"checkpoint.load": plan.relaunch.save} if plan.relaunch else {})}


def planned_config(cfg: Any, *, sweep_job: Any = None, explicit: Optional[bool] = None,
                   resolve: Callable[[Any], Config] = as_config) -> tuple[Config, RunDirPlan]:
    """The resolved config whose `run.dir` is the planned folder, and the plan (no side effects).

    The default folder names the model the run builds: when `resolve` replaced `model.name` (the
    trainer's resolve applies `checkpoint.use_checkpoint_args`), the folder is planned again under
    that name, with `checkpoint.load` kept where it was read from.

    Args:
        cfg: the composed config (`DictConfig` or `Config`); the caller's object is left alone.
        sweep_job, explicit: as `plan_run_dir`.
        resolve: composed config → `Config` (`as_config`, plus what the caller applies to it).
    Raises:
        ConfigError (``symmetric``): the folder is refused; a `checkpoint.save` inside it cannot be
            written or holds checkpoints this run does not resume from (outside it: the trainer's
            checkpoint checks).
    """
    plan = plan_run_dir(cfg, sweep_job=sweep_job, explicit=explicit, resolve=resolve)
    config = resolve(_with(cfg, _planned_keys(plan)))
    is_default = sweep_job is None and not _select(cfg, "run.dir")
    if is_default and default_run_dir(config) != plan.configured:
        cfg = _with(cfg, {"model.name": config.model.name, "checkpoint.load": config.checkpoint.load})
        plan = plan_run_dir(cfg, explicit=explicit, resolve=resolve)
        config = resolve(_with(cfg, _planned_keys(plan)))
    save, load = config.checkpoint.save, config.checkpoint.load
    if save and path_inside(save, Path(plan.dir)):
        _refuse(save_refusal(save) or checkpoint_save_refusal(save, load))
    return config, plan
