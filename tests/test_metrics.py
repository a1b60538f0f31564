"""metrics.jsonl rows (exact DESIGN.md §2 keys), train.log, console pacing, resume truncation."""

import io
import json
import logging
import math

import pytest

from mptrain.training.console import Console
from mptrain.training.metrics import TRAIN_KEYS, EvalRow, MetricsWriter, TrainRow, read_metrics
from mptrain.training.throughput import throughput

DESIGN_TRAIN_ROW = (
    '{"split": "train", "iteration": 7, "consumed_samples": 56, "lm_loss": 6.93, "lr": 3e-4, '
    '"grad_norm": 1.2, "loss_scale": 65536.0, "skipped_iter": false, "skipped_iters_total": 3, '
    '"nan_iters_total": 0, "global_batch_size": 8, "num_microbatches": 4, "tokens_per_s": 1234.5, '
    '"tflops_per_gpu": 1.2, "mfu": null, "mem_allocated_gib": null}'
)


def _row(iteration, **kw):
    base = dict(iteration=iteration, consumed_samples=8 * iteration, lm_loss=7.0 - 0.1 * iteration, lr=1e-3,
                grad_norm=1.5, loss_scale=1.0, skipped_iter=False, skipped_iters_total=0, nan_iters_total=0,
                global_batch_size=8, num_microbatches=4, tokens_per_s=100.0, tflops_per_gpu=0.01, mfu=None, mem_allocated_gib=None)
    base.update(kw)
    return TrainRow(**base)


def test_train_keys_are_exactly_the_design_row_in_order():
    assert list(TRAIN_KEYS) == list(json.loads(DESIGN_TRAIN_ROW).keys())
    design = json.loads(DESIGN_TRAIN_ROW)
    row = TrainRow(**{k: v for k, v in design.items() if k != "split"})
    assert row.as_dict() == design


def test_writer_rows_flushed_per_row_and_eval_ppl(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, rank=0, log_interval=2, train_iters=3, progress_bar=False, stream=out)
    w.write_eval(EvalRow("valid", 0, 2.0))
    w.write_train(_row(1))
    # flushed: readable before close
    assert [r["split"] for r in read_metrics(tmp_path)] == ["valid", "train"]
    w.write_train(_row(2, grad_norm=None, skipped_iter=True, skipped_iters_total=1))
    w.write_train(_row(3, lm_loss=float("nan"), nan_iters_total=1))
    w.write_eval(EvalRow("test", 3, 1.5))
    w.close()
    rows = read_metrics(tmp_path)
    assert [(r["split"], r["iteration"]) for r in rows] == [("valid", 0), ("train", 1), ("train", 2), ("train", 3), ("test", 3)]
    for r in rows:
        if r["split"] == "train":
            assert list(r) == list(TRAIN_KEYS)
        else:
            assert list(r) == ["split", "iteration", "lm_loss", "ppl"]
    assert rows[0]["ppl"] == pytest.approx(math.exp(2.0), rel=1e-12)  # float64 exp; only rounding
    assert rows[2]["grad_norm"] is None and rows[2]["skipped_iter"] is True
    assert rows[3]["lm_loss"] is None  # non-finite written as null (strict JSON)
    # log_interval=2 paces the console: iterations 2 and 3 (the last), not 1
    lines = out.getvalue().splitlines()
    step_lines = [line for line in lines if line.startswith("iter ") and " | samples " in line]  # not eval lines
    assert [line.split(" |")[0] for line in step_lines] == ["iter 2/3", "iter 3/3"]
    assert "iter 0/3 | valid lm_loss 2.000000 | ppl 7.389" in lines and "iter 3/3 | test lm_loss 1.500000 | ppl 4.482" in lines
    log = (tmp_path / "train.log").read_text().splitlines()
    assert [line for line in log if line.startswith("iter ")] == [line for line in lines if line.startswith("iter ")]


def test_non_zero_rank_writes_nothing(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, rank=1, progress_bar=False, stream=out)
    w.write_train(_row(1))
    w.message("hello")
    w.close()
    assert list(tmp_path.iterdir()) == [] and out.getvalue() == ""


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, rank=0, progress_bar=False, stream=io.StringIO()) as w:
        w.write_eval(EvalRow("valid", 0, 3.0))
        for i in range(1, 7):  # checkpoint saved after iteration 4 (after its evaluation), crash after 6
            w.write_train(_row(i))
            if i == 4:
                w.write_eval(EvalRow("valid", 4, 3.0))
    with MetricsWriter(tmp_path, rank=0, start_iteration=4, progress_bar=False, stream=io.StringIO()) as w:
        w.write_train(_row(5))
    its = [(r["split"], r["iteration"]) for r in read_metrics(tmp_path)]
    assert its == [("valid", 0), ("train", 1), ("train", 2), ("train", 3), ("train", 4), ("valid", 4), ("train", 5)]


def test_mptrain_logger_goes_to_train_log_while_open(tmp_path):
    w = MetricsWriter(tmp_path, rank=0, progress_bar=False, stream=io.StringIO())
    logging.getLogger("mptrain.checkpoint").info("RNG states re-derived")
    w.close()
    logging.getLogger("mptrain.checkpoint").info("after close")
    text = (tmp_path / "train.log").read_text()
    assert "RNG states re-derived" in text and "after close" not in text


def test_console_progress_bar_and_plain_lines():
    out = io.StringIO()
    c = Console(out, progress_bar=True, total_iters=10)
    c.step(3, "iter 3/10 | lm_loss 1.0", postfix="lm_loss=1.0000")
    c.step(4, None, postfix="lm_loss=0.9000")  # unpaced: the bar moves, no line
    c.message("iter 4/10 | valid lm_loss 2.0")
    assert c.bar.n == 4
    c.close()
    # every line is written whole on a line of its own (tqdm.write clears the bar first), bar redrawn after
    screen = out.getvalue().replace("\r", "\n").splitlines()
    assert "iter 3/10 | lm_loss 1.0" in screen and "iter 4/10 | valid lm_loss 2.0" in screen
    bars = [line for line in screen if line.startswith("train:")]
    assert bars and "4/10" in bars[-1] and "lm_loss=0.9000" in bars[-1]
    plain = io.StringIO()
    c = Console(plain, progress_bar=None, total_iters=10)  # StringIO is not a terminal: plain lines
    assert c.bar is None
    c.step(1, "iter 1")
    c.step(2, None)
    assert plain.getvalue() == "iter 1\n"


def test_writer_with_a_bar_prints_paced_step_lines_above_it(tmp_path):
    out = io.StringIO()
    with MetricsWriter(tmp_path, rank=0, log_interval=2, train_iters=4, progress_bar=True, stream=out) as w:
        for i in range(1, 5):
            w.write_train(_row(i))
    screen = out.getvalue().replace("\r", "\n").splitlines()
    steps = [line.split(" | ")[0] for line in screen if line.startswith("iter ")]
    assert steps == ["iter 2/4", "iter 4/4"]  # the lines themselves, not the bar's postfix
    assert [line for line in screen if line.startswith("train:")][-1].startswith("train: 100%")


def test_step_line_reports_its_interval_as_megatron(tmp_path):
    """Every log_interval-th row closes an interval: mean lm_loss and grad norm over its non-skipped iterations,
    time per iteration = its wall time / its iterations (skipped included) and the rates from that time, its
    skipped and nan iterations; metrics.jsonl keeps each iteration's own row."""
    out = io.StringIO()

    def rates(elapsed_s, global_batch_size=None):  # 1000 tokens and 2 TFLOP an iteration on 2 processes
        return throughput(flops=2e12, tokens=1000, elapsed_s=elapsed_s, num_gpus=2, peak_tflops=None)

    rows = [_row(1, lm_loss=4.0, grad_norm=1.0),
            _row(2, lm_loss=9.0, grad_norm=None, skipped_iter=True, skipped_iters_total=1, nan_iters_total=3),
            _row(3, lm_loss=2.0, grad_norm=2.0, skipped_iters_total=1, nan_iters_total=3),
            _row(4, lm_loss=8.0, grad_norm=None, skipped_iter=True, skipped_iters_total=2, nan_iters_total=3),
            _row(5, lm_loss=7.0, grad_norm=None, skipped_iter=True, skipped_iters_total=3, nan_iters_total=3)]
    times = [0.5, 0.25, 0.75, 0.5, 1.0]
    # a resumed run: the checkpoint's optimizer had counted 2 nan iterations, so iteration 2 is the interval's one
    with MetricsWriter(tmp_path, rank=0, log_interval=3, train_iters=5, progress_bar=False, stream=out, rates=rates,
                       nan_iters_total=2) as w:
        means = [w.write_train(row, step_time_s=t) for row, t in zip(rows, times)]
    assert means[0] is None and means[1] is None and means[3] is None
    assert (means[2].iterations, means[2].skipped, means[2].nan) == (3, 1, 1)
    assert means[2].lm_loss == 3.0 and means[2].grad_norm == 1.5 and means[2].time_per_iteration_s == 0.5
    lines = [line for line in out.getvalue().splitlines() if line.startswith("iter ")]
    assert lines == [
        "iter 3/5 | samples 24 | ms/iter 500.0 | lm_loss 3.000000 | lr 1.000e-03 | grad_norm 1.5000 | loss_scale 1 | "
        "skipped 1 | nan 1 | batch 8 | mb 4 | tokens/s 2000.0 | TFLOP/s/GPU 2.00 | MFU -",
        # the last iteration closes a shorter interval; all of it skipped: no mean loss or grad norm
        "iter 5/5 | samples 40 | ms/iter 750.0 | lm_loss - | lr 1.000e-03 | grad_norm - | loss_scale 1 | "
        "skipped 2 | nan 0 | batch 8 | mb 4 | tokens/s 1333.3 | TFLOP/s/GPU 1.33 | MFU -",
    ]
    assert [r["lm_loss"] for r in read_metrics(tmp_path)] == [4.0, 9.0, 2.0, 8.0, 7.0]


def test_interval_rates_follow_the_rows_batch_sizes():
    """Under train.rampup_batch_size an interval's iterations process fewer samples than train.global_batch_size:
    its rates are those of its mean batch (2 + 6 samples in 2 × 0.5 s: 8 samples a second), not of the full one."""
    from mptrain.training.interval import Interval

    seen = []

    def rates(elapsed_s, global_batch_size=None):  # 100 tokens a sample, 1 process
        seen.append(global_batch_size)
        return throughput(flops=1e12, tokens=100 * (8 if global_batch_size is None else global_batch_size),
                          elapsed_s=elapsed_s, num_gpus=1, peak_tflops=None)

    interval = Interval(rates=rates)
    interval.add(_row(1, global_batch_size=2), 0.5)
    interval.add(_row(2, global_batch_size=6), 0.5)
    means = interval.close()
    assert seen == [4.0] and means.time_per_iteration_s == 0.5
    assert means.tokens_per_s == pytest.approx(800.0)  # (2 + 6) × 100 tokens in 1 s
