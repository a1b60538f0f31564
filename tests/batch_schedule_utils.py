"""The small sample-based run that tests/test_rampup.py and tests/test_step_batch_size.py vary the global batch of."""

SAMPLE_BASED = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
                "train.eval_interval=null", "train.micro_batch_size=1", "train.global_batch_size=8",
                "train.train_iters=null", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.lr_decay_style=linear",
                "optim.lr_warmup_samples=4", "optim.lr_decay_samples=24"]
"""Overrides of a run trained by samples: LR warm-up over 4 samples, linear decay to 1e-4 at 24 (`lr_after`)."""


def lr_after(n: float) -> float:
    """The LR of `SAMPLE_BASED` after n samples of applied steps: warm-up 4, linear decay to 24."""
    if n <= 4:
        return 1e-3 * n / 4
    return 1e-4 if n > 24 else 1e-4 + (1e-3 - 1e-4) * (1 - (n - 4) / 20)


def straight_run(tmp_path_factory, name: str, overrides: list):
    """The run folder of a single-process run of ``overrides`` (a module fixture's straight reference)."""
    from harness import run_distributed
    from train_utils import run_job

    run_dir = tmp_path_factory.mktemp(name) / "straight"
    run_distributed(run_job, 1, overrides + [f"run.dir={run_dir}"])
    return run_dir


def assert_rows_follow(rows: list, batches: list) -> None:
    """The train rows of a micro-batch-1, dp-1 `SAMPLE_BASED` run whose iterations ran ``batches`` samples each:
    their global batch, micro-batch count, consumed samples, and the LR after the samples of the steps before."""
    import pytest

    assert [r["global_batch_size"] for r in rows] == batches
    assert [r["num_microbatches"] for r in rows] == batches  # micro 1, dp 1
    consumed = [sum(batches[:i + 1]) for i in range(len(batches))]
    assert [r["consumed_samples"] for r in rows] == consumed
    # row i shows the LR its step ran at: after the samples of the steps before it (Megatron's increment)
    assert [r["lr"] for r in rows] == pytest.approx([lr_after(c - b) for c, b in zip(consumed, batches)], rel=1e-12)
