"""Megatron-LM checkpoints in, without megatron-core: ``python -m mptrain.export --import-megatron DIR --output CKPT``.

``reader.py``: the folder, its format (torch_dist or legacy ``model_optim_rng.pt``) and its tensors by name;
``pickles.py``: Megatron's pickles read through an allow-list; ``args.py``: the saved ``args`` as mptrain's model
config (and what it cannot represent); ``convert.py``: names, TP shards joined, the iteration-0 checkpoint written.
"""
