"""What the package ships beside its code: the config tree and the Shakespeare corpus.

Both are found inside the `mptrain` package with `importlib.resources`, so one lookup serves a
wheel (`pip install .`: pyproject.toml's package data copies them in), an editable install and a
checkout on PYTHONPATH (where `src/mptrain/conf` and `src/mptrain/data/shakespeare.jsonl.gz` are
links to the repository's top-level `conf/` and `data/shakespeare.jsonl.gz`).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def conf_dir() -> Path:
    """The config tree (`conf/`: `config.yaml`, `plan.yaml` and one folder per config group)."""
    return Path(str(files("mptrain") / "conf"))


def shipped_corpus() -> Path:
    """The shipped corpus, `shakespeare.jsonl.gz` (`data=shakespeare` without `data.corpus`)."""
    return Path(str(files("mptrain.data") / "shakespeare.jsonl.gz"))


def default_cache_dir() -> Path:
    """Where `data=shakespeare` preprocesses the shipped corpus when `data.cache_dir` is unset.

    In a checkout (the corpus is a link into the repository's `data/`): `data/cache/` beside the
    linked file. In an installed package, whose folder may be read-only and is replaced on upgrade:
    the user's cache, `$XDG_CACHE_HOME/mptrain` (default `~/.cache/mptrain`).
    """
    corpus = shipped_corpus()
    if corpus.is_symlink():
        return corpus.resolve().parent / "cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mptrain"
