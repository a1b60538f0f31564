"""The console line at each train.log_interval reports its interval as Megatron's training_log: the means of
the per-iteration numbers metrics.jsonl holds, over a real run with a skipped fp16 iteration."""

from __future__ import annotations

from statistics import mean

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job

TINY = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.eval_interval=null", "run.progress_bar=false"]
TOKENS = 4 * 16  # global batch × seq_length: tokens per iteration


def _step_lines(run_dir) -> list:
    """train.log's step lines as {field: value} ("iter" -> "3/7", "lm_loss" -> "6.874512", ...)."""
    lines = [line for line in (run_dir / "train.log").read_text().splitlines() if " | ms/iter " in line]
    return [dict(field.rsplit(" ", 1) for field in line.split(" | ")) for line in lines]


def test_step_line_is_the_mean_of_its_interval_rows(tmp_path):
    # iteration 5's grads are poisoned: fp16's dynamic scaler skips it (a skip, not a nan iteration)
    run_distributed(run_job, 1, TINY + ["precision=fp16", "loss_scaler.initial_scale=1024", "loss_scaler.hysteresis=1",
                                        "train.train_iters=7", "train.log_interval=3", "debug.nonfinite_grad_rank=0",
                                        "debug.nonfinite_grad_iteration=5", f"run.dir={tmp_path}"])
    rows = read_rows(tmp_path)
    assert [r["iteration"] for r in rows] == list(range(1, 8))  # metrics.jsonl: still one row per iteration
    assert [r["skipped_iter"] for r in rows] == [False] * 4 + [True] + [False] * 2
    lines = _step_lines(tmp_path)
    assert [line["iter"] for line in lines] == ["3/7", "6/7", "7/7"]  # every 3rd iteration and the last
    for line, iterations in zip(lines, ([1, 2, 3], [4, 5, 6], [7])):
        interval = [rows[i - 1] for i in iterations]
        ran = [r for r in interval if not r["skipped_iter"]]
        loss = mean(r["lm_loss"] for r in ran)  # Megatron: the skipped iteration's loss is left out
        assert float(line["lm_loss"]) == pytest.approx(loss, abs=5e-7)  # printed with 6 decimals
        assert float(line["grad_norm"]) == pytest.approx(mean(r["grad_norm"] for r in ran), abs=5e-5)
        if len(ran) > 1:  # the mean, not the last iteration's number
            assert abs(float(line["lm_loss"]) - interval[-1]["lm_loss"]) > 1e-5
        assert (int(line["skipped"]), int(line["nan"])) == (len(interval) - len(ran), 0)
        # each row's time is TOKENS / its tokens_per_s; the line's is their mean, the rates follow from it
        seconds = mean(TOKENS / r["tokens_per_s"] for r in interval)
        assert float(line["ms/iter"]) == pytest.approx(1000 * seconds, abs=0.051)
        assert float(line["tokens/s"]) == pytest.approx(TOKENS / seconds, abs=0.051)
        assert line["lr"] == f"{interval[-1]['lr']:.3e}" and line["samples"] == str(interval[-1]["consumed_samples"])
    assert lines[1]["skipped"] == "1"
