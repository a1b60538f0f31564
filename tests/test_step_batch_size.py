"""Step batch-size schedule (``train.step_batch_size_schedule``, Megatron's ``--step-batch-size-schedule``).

- the parsed schedule, the global batch of every iteration and the iteration count equal Megatron-LM's
  ``StepBatchsizeNumMicroBatchesCalculator`` + ``update_train_iters`` (a port of them below) on random schedules,
  and its GPT-3 175B example's thresholds;
- iteration-based training: the LR schedule counts the samples of each applied step in iterations of
  train.global_batch_size (Megatron's n against lr_*_iters × global_batch_size);
- bad values are one line naming the key, before any collective;
- end to end (fp32, gloo): tp1pp1 and dp2 give the same per-step losses; a run split mid-schedule and resumed is
  bitwise the straight run; metrics.jsonl's ``global_batch_size`` / ``consumed_samples`` / ``lr`` follow the
  schedule; train.log says it.
"""

from __future__ import annotations

import random

import pytest

from batch_schedule_utils import SAMPLE_BASED, assert_rows_follow, straight_run

from mptrain.config.batch_size import BatchSizeSchedule, parse_step_batch_size_schedule
from mptrain.errors import ConfigError

GPT3_175B = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # examples/gpt3/train_gpt3_175b_distributed.sh


def megatron_schedule(schedule_str: str, seq_length: int) -> list:
    """A line-by-line port of ``StepBatchsizeNumMicroBatchesCalculator._parse_schedule`` (with its
    ``_parse_numeric_value``) and ``_validate_schedule`` (megatron/core/num_microbatches_calculator.py)."""
    def parse_numeric_value(value_str):
        value_str = value_str.strip().upper()
        multiplier = 1
        if value_str.endswith('T'):
            multiplier = 1_000_000_000_000
            value_str = value_str[:-1]
        elif value_str.endswith('B'):
            multiplier = 1_000_000_000
            value_str = value_str[:-1]
        elif value_str.endswith('M'):
            multiplier = 1_000_000
            value_str = value_str[:-1]
        elif value_str.endswith('K'):
            multiplier = 1_000
            value_str = value_str[:-1]
        return int(float(value_str) * multiplier)

    schedule = []
    for entry in schedule_str.strip().replace(',', ' ').split():
        if ':' not in entry:
            raise ValueError(entry)
        threshold_str, batch_size_str = entry.split(':', 1)
        threshold = parse_numeric_value(threshold_str)
        batch_size = parse_numeric_value(batch_size_str)
        if seq_length is not None:
            threshold = threshold // seq_length
        schedule.append((threshold, batch_size))
    schedule.sort(key=lambda x: x[0])
    assert len(schedule) > 0
    assert schedule[0][0] == 0
    for i in range(1, len(schedule)):
        assert schedule[i][0] > schedule[i - 1][0]
    for _threshold, batch_size in schedule:
        assert batch_size > 0
    return schedule


def megatron_batch(schedule: list, consumed_samples: int) -> int:
    """``_get_batch_size_for_samples``."""
    batch_size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed_samples >= threshold:
            batch_size = bs
        else:
            break
    return batch_size


def megatron_batches(schedule: list, *, train_samples=None, train_iters=None) -> list:
    """The global batch of each iteration: ``training.update_train_iters``'s loop for train_samples (``while
    consumed_samples < args.train_samples``), or train_iters iterations of the training loop."""
    consumed_samples, batches = 0, []
    while (consumed_samples < train_samples) if train_iters is None else (len(batches) < train_iters):
        batches.append(megatron_batch(schedule, consumed_samples))
        consumed_samples += batches[-1]
    return batches


def _per_iteration(schedule: BatchSizeSchedule, train_iters: int) -> list:
    """The global batch of iterations 1..train_iters, asked the way the loop asks (by consumed samples)."""
    out, consumed = [], 0
    for _ in range(train_iters):
        out.append(schedule.at(consumed))
        consumed += out[-1]
    return out


def _random_schedule(rng: random.Random) -> str:
    """Entries in tokens with random suffixes, order and separators (sometimes invalid, as a user may write)."""
    entries = []
    for k in range(rng.randint(1, 5)):
        tokens = 0 if k == 0 and rng.random() < 0.9 else rng.randint(0, 3000)
        form = rng.choice(["plain", "K", "k", "float"])
        text = {"plain": str(tokens), "K": f"{tokens / 1000:g}K", "k": f"{tokens / 1000:g}k", "float": f"{tokens}.0"}[form]
        entries.append(f"{text}:{rng.choice([rng.randint(1, 24), rng.randint(0, 3)])}")
    rng.shuffle(entries)
    return rng.choice([" ", ",", " , "]).join(entries)


def test_random_schedules_match_megatron():
    rng, valid = random.Random(0), 0
    for _ in range(600):
        text, seq_length = _random_schedule(rng), rng.choice([1, 7, 16, 64])
        try:
            want = megatron_schedule(text, seq_length)
        except (AssertionError, ValueError):
            with pytest.raises(ConfigError):
                parse_step_batch_size_schedule(text, seq_length)
            continue
        valid += 1
        parsed = parse_step_batch_size_schedule(text, seq_length)
        assert list(parsed) == want, text
        schedule = BatchSizeSchedule(8, None, parsed)
        train_samples, train_iters = rng.randint(0, 600), rng.randint(0, 120)
        by_samples = megatron_batches(want, train_samples=train_samples)
        assert schedule.train_iters(train_samples) == len(by_samples), (text, seq_length, train_samples)
        assert _per_iteration(schedule, len(by_samples)) == by_samples
        by_iters = megatron_batches(want, train_iters=train_iters)
        assert _per_iteration(schedule, train_iters) == by_iters
        # runs: the same batches, grouped (what the checks and the log line read)
        assert [r.global_batch_size for r in schedule.runs(train_iters) for _ in range(r.iterations)] == by_iters
    assert valid > 300  # most random schedules are valid ones


def test_gpt3_175b_schedule():
    """Megatron's example at --seq-length 2048: thresholds 2.4B ... 12B tokens are 1171875 ... 5859375 samples
    (12B tokens = the 5859375 samples of the ramp it replaced: --rampup-batch-size 16 16 5859375)."""
    parsed = parse_step_batch_size_schedule(GPT3_175B, 2048)
    assert parsed == ((0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536))
    schedule = BatchSizeSchedule(1536, None, parsed)
    # the batch changes at the first iteration that begins at or after a threshold: 1171875 / 16 = 73242.2 iterations
    assert [(r.first_iteration, r.consumed_samples, r.global_batch_size) for r in schedule.runs(500000)][:2] == [
        (1, 0, 16), (73244, 73243 * 16, 320)]
    train_samples = 146484375  # the ramp-era example's --train-samples
    assert schedule.train_iters(train_samples) == len(megatron_batches(list(parsed), train_samples=train_samples))


def test_iteration_based_lr_counts_samples_in_global_batches():
    """train_iters with a step schedule: Megatron's ``get_optimizer_param_scheduler`` sets W = lr_warmup_iters ×
    global_batch_size and D = lr_decay_iters × global_batch_size samples, and each applied step advances by its
    own samples (``opt_param_scheduler.step(increment=num_microbatches × micro × dp)``)."""
    import types

    from mptrain.optim.lr_scheduler import OptimizerParamScheduler

    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    sched = OptimizerParamScheduler(optimizer, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10,
                                    lr_decay_style="linear", train_iters=12, global_batch_size=8,
                                    step_batch_size_schedule="0:2 4:4 40:8")
    warmup, decay = 2 * 8, 10 * 8  # samples

    def megatron_lr(num_steps):  # OptimizerParamScheduler.get_lr, linear, init_lr 0
        if num_steps <= warmup:
            return 1.0 * float(num_steps) / float(warmup)
        if num_steps > decay:
            return 0.1
        return 0.1 + (1.0 - float(num_steps - warmup) / float(decay - warmup)) * 0.9

    schedule = BatchSizeSchedule(8, None, parse_step_batch_size_schedule("0:2 4:4 40:8", 1))
    samples, got, want = 0, [], []
    for batch in _per_iteration(schedule, 20):  # samples 2, 2, 4 × 9, 8 × 9: past D = 80 at the end
        got.append(sched.get_lr())
        want.append(megatron_lr(samples))
        sched.step(batch)
        samples += batch
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[0] == 0.0 and got[-1] == 0.1 and 0.1 < got[8] < 1.0  # warmup, decay, min_lr all reached


BAD = [
    (['train.step_batch_size_schedule="0:2 64"'], 1, "'64' is not THRESHOLD:BATCH_SIZE"),
    (['train.step_batch_size_schedule="0:2 1X:4"'], 1, "'1X:4' is not THRESHOLD:BATCH_SIZE (numbers with an optional "
                                                       "K, M, B or T suffix"),
    (['train.step_batch_size_schedule=" "'], 1, "has no entry"),
    (['train.step_batch_size_schedule="16:2 64:4"'], 1, "the first threshold must be 0 samples (the batch of the first "
                                                        "iteration), got '16:2' = 1 samples of model.seq_length=16"),
    (['train.step_batch_size_schedule="0:2 20:4 30:8"'], 1, "thresholds must be strictly increasing in samples "
                                                            "(tokens // model.seq_length=16), but '20:4' and '30:8' "
                                                            "are both sample 1"),
    (['train.step_batch_size_schedule="0:2 64:0"'], 1, "'64:0' gives a global batch size of 0; each must be >= 1"),
    (['train.step_batch_size_schedule="0:2 64:4"', "train.rampup_batch_size=[2,2,12]"], 1,
     "and train.rampup_batch_size=[2, 2, 12] both set the global batch of each iteration; set one of them to null"),
    # dp 2 × micro 2 = 4: the schedule's first batch, 2, is not a multiple
    (['train.step_batch_size_schedule="0:2 64:4"', "train.micro_batch_size=2"], 2,
     'train.step_batch_size_schedule="0:2 64:4" reaches a global batch size of 2 (iterations 1-2), which is not '
     "divisible by train.micro_batch_size × data-parallel size = 2 × 2 = 4; make each batch size of the schedule a "
     "multiple of 4"),
    (['train.step_batch_size_schedule="0:4 64:2"'], 1,
     "goes down from a global batch size of 4 (iteration 1) to 2 (iterations 2-14); the number of micro-batches "
     "must not decrease"),
    # interleaved 1F1B needs num_microbatches % pp == 0: the schedule's first batch is 3 micro-batches at pp 2
    (['train.step_batch_size_schedule="0:3 64:4"', "parallel=tp1pp2vpp2"], 2,
     'train.step_batch_size_schedule="0:3 64:4" at iterations 1-2: schedule=interleaved_1f1b needs num_microbatches % '
     "pipeline_model_parallel_size == 0, got 3 micro-batches"),
    (['train.step_batch_size_schedule="0:2 64:4"', "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules."
      "CosineWithRestarts", "+optim.lr_scheduler.cycle_iters=4"], 1,
     "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts does not take "
     "step_batch_size_schedule"),
    (['train.step_batch_size_schedule="0:2 64:4"', "train.train_iters=5"], 1,
     "train.train_iters=5 and train.train_samples=30 are both set"),
]


@pytest.mark.parametrize("overrides,world,message", BAD)
def test_bad_values_are_one_line(overrides, world, message):
    from mptrain.training.validate import validate_config
    from train_utils import compose

    base = ["model=tiny", "model.seq_length=16", "train.micro_batch_size=1", "train.train_iters=null",
            "train.train_samples=30"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose(base + overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- end to end: thresholds 64 and 160 tokens = samples 4 and 10 at seq_length 16; train_samples 26 ---------------
# batches 2, 2, 4, 4, 8, 8 (consumed before: 0, 2, 4, 8, 12, 20): the last ends at 28 > 26, trained whole (Megatron)
SCHEDULE = "0:2 64:4 160:8"
STEPS = [*SAMPLE_BASED, f'train.step_batch_size_schedule="{SCHEDULE}"', "train.train_samples=26"]
BATCHES = [2, 2, 4, 4, 8, 8]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return straight_run(tmp_path_factory, "step_batch_size", STEPS)


def test_rows_follow_the_schedule_and_the_lr_counts_samples(straight):
    from omegaconf import OmegaConf

    from train_utils import read_rows

    assert_rows_follow(read_rows(straight), BATCHES)
    log = (straight / "train.log").read_text()
    assert (f'step batch-size schedule (train.step_batch_size_schedule="{SCHEDULE}", thresholds in tokens // '
            "model.seq_length=16): global batch 2 from sample 0, 4 from sample 4, 8 from sample 10; iterations "
            "1-2: 2 (2 mb), 3-4: 4 (4 mb), 5-6: 8 (8 mb)") in log
    train = OmegaConf.load(straight / "config.yaml").train  # the derived iteration count is recorded
    assert (train.train_iters, train.step_batch_size_schedule) == (6, SCHEDULE)


def test_dp2_agrees_step_by_step(straight, tmp_path):
    from harness import run_distributed
    from train_utils import read_rows, run_job

    run_distributed(run_job, 2, STEPS + [f"run.dir={tmp_path}"])
    want, got = read_rows(straight), read_rows(tmp_path)
    for key in ("global_batch_size", "consumed_samples", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["num_microbatches"] for r in got] == [b // 2 for b in BATCHES]
    assert [r["lm_loss"] for r in got] == pytest.approx([r["lm_loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)


def test_resume_mid_schedule_is_bitwise(straight, tmp_path):
    """Saved after iteration 3 (the first of batch 4) and resumed: the straight run's rows, bitwise."""
    from harness import run_distributed
    from train_utils import read_rows, run_job, without_timing

    ckpt = tmp_path / "ckpt"
    run_distributed(run_job, 1, STEPS + [f"run.dir={tmp_path / 'split'}", f"checkpoint.save={ckpt}",
                                         "train.exit_interval=3"])
    assert [r["iteration"] for r in read_rows(tmp_path / "split")] == [1, 2, 3]
    run_distributed(run_job, 1, STEPS + [f"run.dir={tmp_path / 'split'}", f"checkpoint.load={ckpt}",
                                         f"checkpoint.save={ckpt}"])
    assert without_timing(read_rows(tmp_path / "split")) == without_timing(read_rows(straight))
