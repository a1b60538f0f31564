"""Tensor-parallel layers and the GPT model chunk (see docs/ARCHITECTURE.md "Model chunk").

Public entry points: `build_model_chunks`, `GPTModel`, `pipeline_layer_ranges`,
`check_model_config`, `check_model_components` (gpt.py); `build_module`, `check_spec_tree` (spec.py, the
layer spec tree); `vocab_parallel_cross_entropy`; `RNGStatesTracker`,
`init_rng_tracker`, `checkpoint` (random.py); `count_parameters` (params.py); `ShardSpec`,
`collect_shard_specs` (sharding.py).
"""
