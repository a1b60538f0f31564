"""mptrain entry point: `torchrun --nproc_per_node=N train.py [group=option ...] [key=value ...]`.

Thin by design: the same entry as `python -m mptrain.train` (`mptrain.train.cli`), kept at the
top of the checkout for the torchrun command lines.
"""

from mptrain.train import cli

if __name__ == "__main__":
    cli()
