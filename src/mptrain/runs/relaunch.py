"""A relaunch: the same command started again on its run folder resumes there (DESIGN.md §2).

Megatron-LM's habit is one command for every job of a run (``--save D --load D``): a job ended by a
time limit, a signal or a failure is started again as it was, and it loads ``D``'s latest checkpoint.
mptrain does the same without ``checkpoint.load`` on the command line: a folder holding a run is
resumed in place when this run's ``checkpoint.save`` holds a complete checkpoint, ``checkpoint.load`` is
null or that same folder, and the folder's ``config.yaml`` equals this run's config but for
`RESUME_KEYS`. A config that differs elsewhere is another run (`mptrain.runs.folder` moves it to
``<dir>-N`` and the line names the first key that differs).

Pure: reads the folder's config.yaml and the checkpoint folder's names, writes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from mptrain.checkpoint.atomic import resolve_load_dir
from mptrain.config.schema import config_to_container

RESUME_KEYS = (
    # how far the run goes (raised to train on, as with Megatron's --train-iters) and where this job stops
    "train.train_iters", "train.train_samples", "train.exit_interval", "train.exit_duration_in_mins",
    # this job's watchdogs and console
    "train.timeout_s", "train.step_timeout_s", "train.log_interval", "run.progress_bar",
    # what the job resumes from: null on the first job, the save folder after it; use_checkpoint_args
    # resolves against that folder, and what it brings (model.*, data.tokenizer) is compared
    "checkpoint.load", "checkpoint.load_iteration", "checkpoint.use_checkpoint_args",
    # when and how it saves
    "checkpoint.save_interval", "checkpoint.keep_last_n", "checkpoint.async_save",
    # fault injection: the stop a test provokes
    "debug.",
)
"""Keys (a trailing ``.``: a whole group) that may change between the jobs of one run."""

SHOWN_KEYS = 3
"""Keys a line names before it says how many more differ."""


def flatten(node: Any, prefix: str = "") -> dict:
    """``{dotted key: value}`` of a nested dict (an empty dict stays a leaf)."""
    if isinstance(node, dict):
        out: dict = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def yaml_container(container: dict) -> dict:
    """`container` as config.yaml stores it and reads back (`mptrain.runs.claim.write_config`): the same
    floats, lists for tuples, so that a saved config and a live one compare equal."""
    return OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(OmegaConf.create(container))))


def is_resume_key(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_KEYS)


_MISSING = object()  # a key one of the two configs lacks


def _show(value: Any) -> str:
    return "<missing>" if value is _MISSING else repr(value)


@dataclasses.dataclass(frozen=True)
class Relaunch:
    """This run is the command of the run in `folder` started again (`relaunch_of`).

    Attributes:
        folder: the run folder (as the config names it).
        save: ``checkpoint.save`` as the config resolves in `folder`: the checkpoints this run resumes from.
        iteration: the checkpoint it loads (``checkpoint.load_iteration``, else the latest complete one).
        differs: ``(key, saved, now)`` of the keys outside `RESUME_KEYS` whose values differ (empty: the same run).
        changed: the same for the `RESUME_KEYS` that changed (``train.train_iters`` raised, ...).
        unreadable: the folder's config.yaml is missing or not a config (never the same run).
    """

    folder: str
    save: str
    iteration: int
    differs: tuple = ()
    changed: tuple = ()
    unreadable: bool = False

    @property
    def same_run(self) -> bool:
        return not self.differs and not self.unreadable

    @staticmethod
    def _keys(items: tuple) -> str:
        shown = "; ".join(f"{key} {_show(saved)} there, {_show(now)} here" for key, saved, now in items[:SHOWN_KEYS])
        more = len(items) - SHOWN_KEYS
        return shown + (f"; {more} more keys differ" if more > 0 else "")

    @property
    def resume_line(self) -> str:
        """The log line of a relaunch that resumes in `folder`."""
        # what the relaunch itself sets (checkpoint.load and what resolves from it) and a test's faults go unsaid
        quiet = ("checkpoint.load", "checkpoint.use_checkpoint_args", "debug.")
        changed = tuple(c for c in self.changed if not c[0].startswith(quiet))
        also = f"; {self._keys(changed)}" if changed else ""
        return (f"run.dir: {self.folder} holds this run (same config{also}): resuming there from "
                f"checkpoint.save={self.save} at iteration {self.iteration}")

    def finished_line(self, train_iters: int) -> str:
        """The one line of a relaunch whose checkpoint is at or past ``train.train_iters``."""
        return (f"run.dir: {self.folder} holds this run, finished: checkpoint.save={self.save} is at iteration "
                f"{self.iteration} >= train.train_iters={train_iters}; nothing to train, nothing written (raise "
                "train.train_iters to train on)")

    @property
    def difference(self) -> str:
        """Why this is another run: the keys whose values differ from the folder's config.yaml."""
        if self.unreadable:
            return f"{self.folder}/config.yaml is missing or unreadable"
        return f"{self.folder}/config.yaml differs: {self._keys(self.differs)}"


def relaunch_of(folder: str | Path, config: Any) -> Optional[Relaunch]:
    """Whether `config` relaunches the run in `folder`, and how its config compares (no side effects).

    Args:
        folder: a folder holding a run (`mptrain.runs.folder.holds_run`).
        config: this run's resolved `Config` with ``run.dir`` = `folder` (``checkpoint.save`` resolved there).
    Returns:
        None when this run cannot be a relaunch: ``checkpoint.save`` unset or holding no complete checkpoint
        (or not ``checkpoint.load_iteration``), ``checkpoint.load`` set to another folder, or
        ``checkpoint.finetune`` (a new run from weights); else the `Relaunch`, whose ``differs`` says
        whether it is the same run.
    """
    ck = config.checkpoint
    save, load = ck.save, ck.load
    if not save or ck.finetune or (load and Path(load).resolve() != Path(save).resolve()):
        return None
    try:
        loaded, _ = resolve_load_dir(str(save), ck.load_iteration)
    except FileNotFoundError:  # load_iteration not complete there: the checkpoint checks refuse it
        return None
    if loaded is None:
        return None
    saved = _saved_config(Path(folder) / "config.yaml")
    iteration = int(loaded.name.rpartition("_")[2])
    if saved is None:
        return Relaunch(folder=str(folder), save=str(save), iteration=iteration, unreadable=True)
    now = flatten(yaml_container(config_to_container(config)))
    differs, changed = [], []
    for key in sorted((set(saved) | set(now)) - {"run.dir"}):
        before, after = saved.get(key, _MISSING), now.get(key, _MISSING)
        if before != after:
            (changed if is_resume_key(key) else differs).append((key, before, after))
    return Relaunch(folder=str(folder), save=str(save), iteration=iteration, differs=tuple(differs),
                    changed=tuple(changed))


def _saved_config(path: Path) -> Optional[dict]:
    """The flattened config.yaml of a run folder (None when it is missing or not a config)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - unreadable or not YAML (PyYAML's errors): not this run's config
        return None
    return flatten(saved) if isinstance(saved, dict) and saved else None
