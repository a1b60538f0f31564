"""Imported last by the `procs` forkserver: its preloaded modules leave the cyclic GC (`gc.freeze`),
so that every forked child skips re-traversing them at each full collection (suite time)."""

import gc

gc.collect()
gc.freeze()
