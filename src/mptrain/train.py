"""Training entry point: `python -m mptrain.train`, the `mptrain-train` command and `train.py`.

    python -m mptrain.train [group=option ...] [key=value ...]                       # world size 1
    python -m mptrain.launch --nproc_per_node=N -m mptrain.train [overrides]         # N processes
    torchrun --nproc_per_node=N train.py [overrides]                                 # from a checkout

Hydra composes the config from the package's `conf/` (`mptrain.resources.conf_dir`);
`mptrain.training.run.hydra_main` does the rest. Ends: 0 when done (or stopped by SIGTERM); 1
with one line for a config error; 130 with one line for Ctrl-C (`mptrain.training.interrupt`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra

from mptrain.config.cli import TRAIN_PROGRAM, exit_on_compose_error
from mptrain.config.schema import register
from mptrain.resources import conf_dir
from mptrain.training.interrupt import exit_interrupted

register()
CONF = conf_dir()


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def main(cfg):
    """Hydra's task function: one job (or one job of a sweep); returns its JobResult dict."""
    from mptrain.training.run import hydra_main

    return hydra_main(cfg)  # the JobResult: the sweep summary records it


def program() -> str:
    """The command the user ran, as an error's fix names it: ``python -m mptrain.train``, ``mptrain-train`` or
    (a checkout's) ``python train.py``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "mptrain.train":
        return "python -m mptrain.train"
    return "mptrain-train" if Path(sys.argv[0]).name == "mptrain-train" else TRAIN_PROGRAM


def cli() -> None:
    """Compose-check the command line (one line, rank 0, exit 1 for an override Hydra cannot compose), then run."""
    try:
        exit_on_compose_error(str(CONF), program=program())
        main()
    except KeyboardInterrupt:  # Ctrl-C before the training loop took over SIGINT
        exit_interrupted(None)


if __name__ == "__main__":
    cli()
