"""mptrain: a declarative, Hydra-configured trainer for GPT models with Megatron-style 3-D parallelism."""

__version__ = "0.1.0"
