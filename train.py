"""mptrain entry point: `torchrun --nproc_per_node=N train.py [group=option ...] [key=value ...]`.

Thin by design: Hydra composes the config; `mptrain.training.run.main` does the rest.
"""

import os
from pathlib import Path

import hydra

from mptrain.config.cli import exit_on_compose_error
from mptrain.config.schema import register

register()
# the folder Hydra reads for config_path="conf": realpath(dirname(the script's path)), so a symlinked
# train.py reads the conf/ beside the link, as Hydra does
CONF = Path(os.path.realpath(os.path.dirname(os.path.abspath(__file__)))) / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    from mptrain.training.run import hydra_main

    return hydra_main(cfg)  # the JobResult: the sweep summary records it


if __name__ == "__main__":
    exit_on_compose_error(str(CONF))  # an override Hydra cannot compose: one line, rank 0, exit 1
    main()
