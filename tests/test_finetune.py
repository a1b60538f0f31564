"""checkpoint.finetune / load_optim / load_rng, and the optimizer-change check on resume.

- fine-tuning starts at iteration 1 with a fresh optimizer (Adam's step count 1 in its own first
  checkpoint), the new LR schedule, and a step-1 loss equal to the checkpoint's weights evaluated
  on the new data by an independent forward (bitwise in fp32: same kernels, one micro-batch);
- resuming with another optimizer class is one ConfigError naming the fix; with
  checkpoint.load_optim=false it resumes (iteration continues) and the log says what was dropped.
"""

from __future__ import annotations

import warnings

import pytest

from harness import DistributedTestError, run_distributed
from train_utils import compose, read_rows, run_job

SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         "train.global_batch_size=4", "train.micro_batch_size=4", "model.vocab_size=100",
         "model.make_vocab_size_divisible_by=64", "data.vocab_size=100"]
NEW_DATA = ["data.seed=777", "optim.lr=2e-3", "optim.lr_warmup_iters=4"]  # another sample order, a new schedule


def _reference_loss(rank: int, world: int, overrides: list, export_dir: str) -> float:
    """Pool task: the exported weights' mean loss on the first global batch of ``overrides``' data."""
    import torch

    from mptrain.checkpoint.offline import load_consolidated
    from mptrain.config.schema import as_config
    from mptrain.data.provider import build_provider
    from mptrain.data.tokenizers import build_tokenizer

    cfg = as_config(compose(overrides))
    provider = build_provider(cfg.data, tokenizer=build_tokenizer(cfg.data), seq_length=cfg.model.seq_length,
                            micro_batch_size=cfg.train.micro_batch_size, global_batch_size=cfg.train.global_batch_size,
                            dp_rank=0, dp_size=1, needs_data=True)
    batch = next(provider.train_iterator(0))
    model = load_consolidated(export_dir).eval()
    with torch.no_grad():
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
    mask = batch["loss_mask"]
    # the trainer's arithmetic: fp32 masked sum, then Σ / count in float64 (training/step.py reduce_loss)
    loss_sum, tokens = (per_token.float() * mask).sum(), mask.sum()
    return float(loss_sum.double()) / float(tokens.double())


def _adam_steps(ckpt) -> set:
    """The distinct Adam ``step`` values saved in a checkpoint's ``latest``."""
    from mptrain.checkpoint import atomic, dcp_io

    folder, _ = atomic.resolve_load_dir(str(ckpt), None)
    keys = [k for k in dcp_io.object_keys(dcp_io.read_metadata(str(folder))) if k.endswith("/step")]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        objs = dcp_io.load_chunks(str(folder), [], keys, no_dist=True)
    return {float(v) for v in objs.values()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    run_distributed(run_job, 1, SMALL + ["train.train_iters=3", f"run.dir={root / 'run'}", f"checkpoint.save={root / 'ckpt'}"])
    return root


def test_finetune_starts_fresh_on_the_new_data(pretrained, tmp_path):
    from mptrain.checkpoint.offline import export_consolidated

    ckpt, ft_ckpt = pretrained / "ckpt", tmp_path / "ft_ckpt"
    assert _adam_steps(ckpt) == {3.0}
    overrides = SMALL + NEW_DATA + ["train.train_iters=2", f"run.dir={tmp_path / 'ft'}", f"checkpoint.load={ckpt}",
                                    "checkpoint.finetune=true", f"checkpoint.save={ft_ckpt}"]
    run_distributed(run_job, 1, overrides)
    rows = read_rows(tmp_path / "ft")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert [r["consumed_samples"] for r in rows] == [4, 8]
    # the new schedule from step 0 (warmup 4: lr 0, then 2e-3/4); the checkpoint's step count 3 would give 1.5e-3
    assert [r["lr"] for r in rows] == [0.0, 2e-3 / 4]
    assert _adam_steps(ft_ckpt) == {2.0}  # a fresh optimizer: 2 steps, not 3 + 2
    log = (tmp_path / "ft" / "train.log").read_text()
    assert "fine-tuning from the weights of iteration 3" in log
    export_consolidated(str(ckpt), str(tmp_path / "st"))
    want = run_distributed(_reference_loss, 1, overrides, str(tmp_path / "st"))[0]
    assert rows[0]["lm_loss"] == want  # fp32, one micro-batch, same kernels: bitwise


def test_resume_with_another_optimizer_is_refused_or_logged(pretrained, tmp_path):
    ckpt = pretrained / "ckpt"
    base = SMALL + ["train.train_iters=4", f"checkpoint.load={ckpt}"]
    with pytest.raises(DistributedTestError) as err:
        run_distributed(run_job, 1, base + ["optim=sgd", f"run.dir={tmp_path / 'a'}"])
    msg = str(err.value)
    assert "ConfigError: checkpoint.load:" in msg and "optimizer changed" in msg
    assert "set checkpoint.load_optim=false" in msg and "checkpoint.finetune=true" in msg
    run_distributed(run_job, 1, base + ["optim=sgd", "checkpoint.load_optim=false", f"run.dir={tmp_path / 'b'}"])
    assert [r["iteration"] for r in read_rows(tmp_path / "b")] == [4]  # resumed: iteration 3 + 1
    log = (tmp_path / "b" / "train.log").read_text()
    assert "optimizer state and loss scaler not loaded (checkpoint.load_optim=false)" in log
    assert "torch.optim.sgd.SGD" in log  # the class the run built, whatever config key selected it


def test_optimizer_change_from_state_keys_and_classes():
    """The check on its own: by saved class (optim._target_), and by state keys when the config names none."""
    import torch

    from mptrain.checkpoint.finetune import optimizer_change

    p = [torch.nn.Parameter(torch.zeros(3))]
    adam, sgd = torch.optim.Adam(p), torch.optim.SGD(p, lr=0.1, momentum=0.9)
    tkeys = {"model/w": ((3,), []), "optim/w/exp_avg": ((3,), []), "optim/w/exp_avg_sq": ((3,), [])}
    okeys = {"optim/w/step"}
    assert optimizer_change(adam, {}, {}, tkeys, okeys) is None
    assert optimizer_change(sgd, {}, {}, tkeys, okeys) == (
        "the checkpoint holds optimizer state ['exp_avg', 'exp_avg_sq', 'step'], torch.optim.sgd.SGD keeps "
        "['momentum_buffer']")
    assert optimizer_change(torch.optim.AdamW(p), {"optim": {"_target_": "torch.optim.Adam"}}, {}, tkeys, okeys) == (
        "the checkpoint was saved with optim._target_=torch.optim.Adam (torch.optim.adam.Adam), this run builds "
        "torch.optim.adamw.AdamW")
    assert optimizer_change(sgd, {}, {}, {"model/w": ((3,), [])}, set()) is None  # no saved state: nothing to drop
    bad = {"model/w": ((3,), []), "optim/w/exp_avg": ((2,), []), "optim/w/exp_avg_sq": ((3,), [])}
    assert "optim/w/exp_avg [2] vs the parameter's [3]" in optimizer_change(adam, {}, {}, bad, okeys)


def test_load_rng_false_rederives_and_finetune_needs_load(pretrained, tmp_path):
    from mptrain.training.validate import validate_config
    from mptrain.errors import ConfigError

    run_distributed(run_job, 1, SMALL + ["train.train_iters=4", f"checkpoint.load={pretrained / 'ckpt'}",
                                         "checkpoint.load_rng=false", f"run.dir={tmp_path / 'r'}"])
    log = (tmp_path / "r" / "train.log").read_text()
    assert "RNG states re-derived from train.seed=1234, iteration 3" in log and "checkpoint.load_rng=false" in log
    with pytest.raises(ConfigError, match=r"^checkpoint.finetune=true needs checkpoint.load="):
        validate_config(compose(SMALL + ["checkpoint.finetune=true"]), 1)
    with pytest.raises(ConfigError, match=r"checkpoint.save=checkpoint.load=.*save to another folder"):
        validate_config(compose(SMALL + ["checkpoint.finetune=true", "checkpoint.load=/x", "checkpoint.save=/x"]), 1)
