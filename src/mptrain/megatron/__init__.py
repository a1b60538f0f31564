"""Megatron-LM launches as mptrain commands: `shell` reads a launch script, `table` maps each argument, `translate` applies it."""
