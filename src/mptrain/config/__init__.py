"""Typed config schemas (one module per config group), registered in Hydra's ConfigStore by `schema.register`."""
