"""Batch-size ramp-up (``train.rampup_batch_size``, Megatron's ``--rampup-batch-size``).

- the global batch of every iteration and the iteration count equal Megatron's
  ``RampupBatchsizeNumMicroBatchesCalculator`` + ``update_train_iters`` (a port of them below, and tables);
- the samples each iteration reads are [c, c + G) of the one order, on every DP rank layout;
- bad values are one line naming the key, before any collective;
- end to end (fp32, gloo): tp1pp1, dp2 and tp2pp2 give the same per-step losses; a run split mid-ramp and
  resumed is bitwise the straight run; metrics.jsonl's ``global_batch_size`` / ``consumed_samples`` / ``lr``
  follow the ramp and the sample-based LR schedule; train.log says the ramp.
"""

from __future__ import annotations

import random

import pytest

from batch_schedule_utils import SAMPLE_BASED, assert_rows_follow, straight_run

from mptrain.config.batch_size import BatchSizeSchedule
from mptrain.data.sampler import PretrainingSampler
from mptrain.errors import ConfigError


def megatron_batches(global_batch_size: int, ramp: tuple, train_samples: int) -> tuple[list, int]:
    """(global batch per ramp iteration, train_iters) as Megatron-LM computes them: a line-by-line port of
    ``RampupBatchsizeNumMicroBatchesCalculator.update`` and ``training.update_train_iters``."""
    start, increment, ramp_samples = ramp
    rampup_samples_per_increment = ramp_samples / ((global_batch_size - start) // increment)

    def update(consumed_samples):
        if consumed_samples > ramp_samples:
            return global_batch_size
        steps = int(consumed_samples / rampup_samples_per_increment)
        return start + steps * increment

    iterations, consumed_samples, batches = 0, 0, []
    while consumed_samples <= ramp_samples and consumed_samples <= train_samples:
        batches.append(update(consumed_samples))
        consumed_samples += batches[-1]
        iterations += 1
    if train_samples > consumed_samples:
        iterations += (train_samples - consumed_samples) // global_batch_size
    return batches, iterations


def _per_iteration(schedule: BatchSizeSchedule, train_iters: int) -> list:
    """The global batch of iterations 1..train_iters, asked the way the loop asks (by consumed samples)."""
    out, consumed = [], 0
    for _ in range(train_iters):
        out.append(schedule.at(consumed))
        consumed += out[-1]
    return out


# (global_batch_size, [start, increment, ramp_samples], train_samples) -> (global batch per iteration, train_iters)
TABLE = [
    # the module docstring's example: one increment every 32 / 3 = 10.67 samples
    ((8, (2, 2, 32), 64), ([2] * 6 + [4] * 3 + [6] * 2 + [8] * 3, 14)),
    # 4 samples per increment; 30 samples = the ramp's 4 iterations (14 samples) then 2 full batches
    ((8, (2, 2, 12), 30), ([2, 2, 4, 6, 8, 8], 6)),
    # train_samples inside the ramp: Megatron trains through the batch that crosses it (2+2+4 = 8 > 5)
    ((8, (2, 2, 12), 5), ([2, 2, 4], 3)),
    # 1 sample per increment, faster than the batches consume: 3 and 5 are never reached; 7 + 2 × 6 = 19 of 20
    ((6, (1, 1, 5), 20), ([1, 2, 4, 6, 6], 5)),
    # one increment: iterations beginning at 0, 16, ..., 96 <= 100 at 16, then (300 - 112) // 32 = 5 at 32
    ((32, (16, 16, 100), 300), ([16] * 7 + [32] * 5, 12)),
]


@pytest.mark.parametrize("args,want", TABLE)
def test_global_batch_per_iteration_is_megatrons_table(args, want):
    gbs, ramp, train_samples = args
    batches, train_iters = want
    schedule = BatchSizeSchedule(gbs, ramp)
    assert schedule.train_iters(train_samples) == train_iters
    assert _per_iteration(schedule, train_iters) == batches
    megatron, megatron_iters = megatron_batches(gbs, ramp, train_samples)
    assert (batches[:len(megatron)], megatron_iters) == (megatron, train_iters)


def test_random_ramps_match_megatron_and_gpt3_175b():
    rng = random.Random(0)
    for _ in range(400):
        start, increment, n = rng.randint(1, 12), rng.randint(1, 8), rng.randint(1, 20)
        gbs, ramp = start + n * increment, (start, increment, rng.randint(1, 800))
        train_samples = rng.randint(0, 1200)
        schedule = BatchSizeSchedule(gbs, ramp)
        batches, iters = megatron_batches(gbs, ramp, train_samples)
        assert schedule.train_iters(train_samples) == iters, (gbs, ramp, train_samples)
        assert _per_iteration(schedule, len(batches)) == batches, (gbs, ramp, train_samples)
        # phases: the same batches, grouped
        assert [p.global_batch_size for p in schedule.phases(train_samples) for _ in range(p.iterations)] == batches
    # Megatron's GPT-3 175B example: --rampup-batch-size 16 16 5859375 --global-batch-size 1536 --train-samples 146484375
    schedule, (batches, iters) = BatchSizeSchedule(1536, (16, 16, 5859375)), megatron_batches(1536, (16, 16, 5859375),
                                                                                              146484375)
    assert schedule.train_iters(146484375) == iters
    assert [p.global_batch_size for p in schedule.phases(146484375) for _ in range(p.iterations)] == batches
    # 95 increments of 16: every batch 16, 32, ..., 1520 runs inside the ramp; 1536 from the first iteration after it
    assert [p.global_batch_size for p in schedule.phases()] == list(range(16, 1536, 16))


@pytest.mark.parametrize("micro_batch_size,dp", [(1, 1), (1, 2), (2, 2)])
def test_each_iteration_reads_its_own_samples(micro_batch_size, dp):
    """Micro-step streams of every DP rank, drawn G / (b × dp) at a time: iteration i reads exactly [c_i, c_i + G_i)."""
    schedule = BatchSizeSchedule(8, (4, 4, 12))  # batches 4, 4, 4, 8, 8, ...
    streams = [iter(PretrainingSampler(micro_batch_size=micro_batch_size, dp_rank=r, dp_size=dp)) for r in range(dp)]
    consumed = 0
    for _ in range(6):
        m = schedule.num_microbatches(consumed, micro_batch_size=micro_batch_size, data_parallel_size=dp)
        read = sorted(i for stream in streams for _ in range(m) for i in next(stream))
        assert read == list(range(consumed, consumed + schedule.at(consumed)))
        consumed += schedule.at(consumed)
    assert consumed == 4 * 3 + 8 * 3


BAD = [
    (["train.rampup_batch_size=[2,2]"], 1, "train.rampup_batch_size=[2, 2] must be [start, increment, ramp_samples]"),
    (["train.rampup_batch_size=[0,2,12]"], 1, "start, increment and ramp_samples must each be >= 1"),
    (["train.rampup_batch_size=[2,2,0]"], 1, "start, increment and ramp_samples must each be >= 1"),
    (["train.rampup_batch_size=[8,2,12]"], 1, "starts at 8, which must be below train.global_batch_size=8"),
    (["train.rampup_batch_size=[2,4,12]"], 1, "train.global_batch_size - start = 8 - 2 = 6 is not a multiple of "
                                              "increment=4"),
    (["train.rampup_batch_size=[2,2,12]", "train.train_samples=null", "train.train_iters=6"], 1,
     "needs training by samples (Megatron: no batch-size ramp-up for iteration-based training); set "
     "train.train_samples=<samples> and train.train_iters=null"),
    (["train.rampup_batch_size=[2,2,12]", "train.train_iters=5"], 1,
     "train.train_iters=5 and train.train_samples=30 are both set"),
    # dp 2 × micro 2 = 4: the ramp's first batch, 2, is not a multiple
    (["train.rampup_batch_size=[2,2,12]", "train.micro_batch_size=2"], 2,
     "reaches a global batch size of 2 (iterations 1-2), which is not divisible by train.micro_batch_size × "
     "data-parallel size = 2 × 2 = 4; make start and increment multiples of 4"),
    # interleaved 1F1B needs num_microbatches % pp == 0: the ramp's first batch, 3, is 3 micro-batches at pp 2
    (["train.rampup_batch_size=[3,1,10]", "parallel=tp1pp2vpp2"], 2,
     "train.rampup_batch_size=[3, 1, 10] at iteration 1: schedule=interleaved_1f1b needs num_microbatches % "
     "pipeline_model_parallel_size == 0, got 3 micro-batches"),
    (["train.rampup_batch_size=[2,2,12]", "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts",
      "+optim.lr_scheduler.cycle_iters=4"], 1,
     "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts does not take rampup_batch_size"),
]


@pytest.mark.parametrize("overrides,world,message", BAD)
def test_bad_values_are_one_line(overrides, world, message):
    from mptrain.training.validate import validate_config
    from train_utils import compose

    base = ["model=tiny", "train.micro_batch_size=1", "train.train_iters=null", "train.train_samples=30"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose(base + overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- end to end: 6 iterations of batches 2, 2, 4, 6, 8, 8 (the TABLE's second row) -----------------------------
RAMP = [*SAMPLE_BASED, "train.rampup_batch_size=[2,2,12]", "train.train_samples=30"]
BATCHES = [2, 2, 4, 6, 8, 8]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return straight_run(tmp_path_factory, "rampup", RAMP)


def test_rows_follow_the_ramp_and_the_lr_counts_samples(straight):
    from train_utils import read_rows

    assert_rows_follow(read_rows(straight), BATCHES)
    log = (straight / "train.log").read_text()
    assert ("batch-size ramp-up (train.rampup_batch_size=[2, 2, 12]): global batch 2 -> 8 by 2 every 4 samples; "
            "iterations 1-2: 2 (2 mb), 3: 4 (4 mb), 4: 6 (6 mb), 5-6: 8 (8 mb)") in log


@pytest.mark.parametrize("world,parallel,dp", [(2, "tp1pp1", 2), (4, "tp2pp2", 1)])
def test_layouts_agree_step_by_step(straight, tmp_path, world, parallel, dp):
    from harness import run_distributed
    from train_utils import read_rows, run_job

    run_distributed(run_job, world, RAMP + [f"parallel={parallel}", f"run.dir={tmp_path}"])
    want, got = read_rows(straight), read_rows(tmp_path)
    for key in ("global_batch_size", "consumed_samples", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["num_microbatches"] for r in got] == [b // dp for b in BATCHES]
    assert [r["lm_loss"] for r in got] == pytest.approx([r["lm_loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)


def test_resume_mid_ramp_is_bitwise(straight, tmp_path):
    """Saved after iteration 3 (batch 4, the ramp's middle) and resumed: the straight run's rows, bitwise."""
    from harness import run_distributed
    from train_utils import read_rows, run_job, without_timing

    ckpt = tmp_path / "ckpt"
    run_distributed(run_job, 1, RAMP + [f"run.dir={tmp_path / 'split'}", f"checkpoint.save={ckpt}", "train.exit_interval=3"])
    assert [r["iteration"] for r in read_rows(tmp_path / "split")] == [1, 2, 3]
    run_distributed(run_job, 1, RAMP + [f"run.dir={tmp_path / 'split'}", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"])
    assert without_timing(read_rows(tmp_path / "split")) == without_timing(read_rows(straight))
