"""Tensor-parallel layers and the GPT model chunk (see docs/ARCHITECTURE.md "Model chunk").

Public entry points: `build_model_chunks`, `GPTModel`, `pipeline_layer_ranges`,
`check_model_config`, `check_model_components` (gpt.py); `LayerContext` (context.py, what every
layer is built with); `build_module` (spec.py), `check_spec_tree` (transformer.py): the layer spec
tree; `apply_compile` (compile.py); `vocab_parallel_cross_entropy`; `RNGStatesTracker`,
`init_rng_tracker`, `checkpoint` (random.py); `count_parameters` (params.py); `ShardSpec`,
`collect_shard_specs` (sharding.py).
"""
