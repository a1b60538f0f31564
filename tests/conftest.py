"""Suite-wide fixture: no test leaves a default process group behind in the pytest process.

`mptrain.training.run.run` keeps the world-1 default group it created (`ParallelGroups.destroy`
releases only the layout's sub-groups, so that the test pool and a sweep's next job reuse it); a
test that calls `run` in this process would otherwise hand it to every later test (test_export
asserts that the consolidated export needs none)."""

import gc

import pytest


@pytest.fixture(autouse=True)
def _long_lived_objects_leave_the_gc():
    """Suite time: what exists before a test (torch, Dynamo, Hydra, earlier tests' caches) is
    long-lived; `gc.freeze` keeps the cyclic GC from re-traversing it at each full collection. The
    collection first frees the previous test's cyclic garbage (frozen, it would never be freed);
    it traverses only what is not frozen yet, so it is short."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _release_the_default_process_group():
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
