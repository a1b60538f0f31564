"""parallel.overlap_param_gather (Megatron's --overlap-param-gather): the distributed optimizer's param all-gather
left running after the step and waited for, bucket by bucket, where the next forward first uses the params.

- after a step the all-gathers are pending and the params unchanged; the embedding's forward pre-hook lands its
  buckets only; the chunk's forward lands the rest, and the params then equal the synchronous gather's bitwise;
- dp2 (world 2) and pp2 × dp2 (world 4, with and without virtual stages): metrics.jsonl (train and evaluation
  rows) and the saved weights and fp32 main params bitwise equal to overlap off; a resume of the checkpoint of
  iteration 2 equals the straight run bitwise;
- the rule (distributed optimizer and overlap_grad_reduce, as Megatron): one ConfigError line.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.training.metrics import read_metrics
from mptrain.training.validate import validate_config
from train_utils import compose, run_job, without_timing

# four layers, a 3000-element bucket: several buckets per chunk; evaluation at 0, 2 and the end reads the params too
SMALL = ["model=tiny", "model.num_layers=4", "model.hidden_size=32", "model.seq_length=16", "model.vocab_size=100",
         "data.vocab_size=100", "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_iters=4",
         "train.eval_interval=2", "train.eval_iters=1", "parallel.use_distributed_optimizer=true",
         "parallel.overlap_grad_reduce=true", "parallel.bucket_size=3000"]
ON, OFF = ["parallel.overlap_param_gather=true"], ["parallel.overlap_param_gather=false"]


@pytest.mark.parametrize("overrides, missing", [
    (["parallel.use_distributed_optimizer=false"], "set parallel.use_distributed_optimizer=true, or"),
    (["parallel.overlap_grad_reduce=false"], "set parallel.overlap_grad_reduce=true, or"),
])
def test_the_rule_is_one_config_error(overrides, missing):
    with pytest.raises(ConfigError, match=f"parallel.overlap_param_gather=true .*; {missing} "
                                          "parallel.overlap_param_gather=false"):
        validate_config(compose(SMALL + ON + overrides), 2)


def _params(chunk) -> dict:
    return {n: p.detach().clone() for n, p in chunk.module.named_parameters()}


def _pending_after_a_step(rank, world):
    from mptrain.config.schema import as_config
    from mptrain.groups import build_groups
    from mptrain.precision.module import unwrap
    from mptrain.training.run import build_model_and_optimizer

    groups = build_groups(1, 1)
    try:
        chunks = {}
        for name, flag in (("off", OFF), ("on", ON)):
            cfg = as_config(compose(SMALL + flag))
            (chunk,), optimizer, _, _, _ = build_model_and_optimizer(cfg, groups, validate_config(cfg, world),
                                                                     vocab_size=100)
            for buf in chunk.grad_buffers:  # the same reduced grads in both: this rank's shard of each bucket is read
                buf.data.copy_(torch.linspace(-1.0, 1.0, buf.numel) * (rank + 1))
            before = _params(chunk)
            assert optimizer.step().result().update_successful
            chunks[name] = (chunk, before)
        (off, before_off), (on, before_on) = chunks["off"], chunks["on"]
        assert all(torch.equal(before_on[n], before_off[n]) for n in before_off)  # the same init
        assert off.pending_param_syncs() == [] and not all(torch.equal(p, before_off[n])
                                                           for n, p in _params(off).items())
        pending = on.pending_param_syncs()
        assert len(pending) == sum(len(b.buckets) for b in on.grad_buffers) > 2
        assert all(torch.equal(p, before_on[n]) for n, p in _params(on).items())  # nothing copied yet
        tokens = torch.arange(32).reshape(2, 16) % 100
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            unwrap(on).embedding(tokens, positions)  # the first region: its pre-hook lands its buckets only
            after_embedding = on.pending_param_syncs()
            assert 0 < len(after_embedding) < len(pending)
            on(tokens, positions, None, tokens)  # the chunk's forward: every region's pre-hook
        assert on.pending_param_syncs() == []
        want = _params(off)
        return sum(not torch.equal(p, want[n]) for n, p in _params(on).items())
    finally:
        groups.destroy()


def test_pending_after_the_step_and_landed_by_the_forward():
    assert run_distributed(_pending_after_a_step, 2) == [0, 0]  # every param equal to the synchronous gather's


def _weights(ckpt) -> list:
    from mptrain.checkpoint.offline import load_full_state

    return [load_full_state(str(ckpt), fp32_master=m)[0] for m in (False, True)]


def _assert_same_weights(got: list, want: list) -> None:
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), [k for k in w if not torch.equal(g[k], w[k])]


def _run(tmp_path, world: int, name: str, overrides: list) -> tuple:
    run_dir, ckpt = tmp_path / name, tmp_path / f"{name}_ckpt"
    run_distributed(run_job, world, SMALL + overrides + [f"run.dir={run_dir}", f"checkpoint.save={ckpt}"])
    return without_timing(read_metrics(run_dir)), _weights(ckpt)


def test_dp2_equals_overlap_off_and_resumes_bitwise(tmp_path):
    # overlap on also saves after iteration 2 (and goes on: the rows and weights of overlap off show that the save
    # changed nothing); "resumed" resumes that checkpoint for iterations 3 and 4
    rows_on, weights_on = _run(tmp_path, 2, "on", ON + ["checkpoint.save_interval=2"])
    rows_off, weights_off = _run(tmp_path, 2, "off", OFF)
    assert [(r["split"], r["iteration"]) for r in rows_on][:4] == [("valid", 0), ("train", 1), ("train", 2), ("valid", 2)]
    assert rows_on == rows_off  # bitwise: == on the floats read back from JSON, evaluation rows included
    _assert_same_weights(weights_on, weights_off)
    resumed, ckpt = tmp_path / "resumed", tmp_path / "resumed_ckpt"
    run_distributed(run_job, 2, SMALL + ON + [f"run.dir={resumed}", f"checkpoint.load={tmp_path / 'on_ckpt'}",
                                              "checkpoint.load_iteration=2", f"checkpoint.save={ckpt}"])
    rows = without_timing(read_metrics(resumed))
    assert rows[0]["iteration"] == 3 and rows == [r for r in rows_on if r["iteration"] > 2]
    _assert_same_weights(_weights(ckpt), weights_on)


@pytest.mark.parametrize("parallel", ["tp1pp2", "tp1pp2vpp2"])
def test_pp2_dp2_equals_overlap_off(tmp_path, parallel):
    rows_on, weights_on = _run(tmp_path, 4, "on", ON + [f"parallel={parallel}"])
    rows_off, weights_off = _run(tmp_path, 4, "off", OFF + [f"parallel={parallel}"])
    assert len(rows_on) == 8 and rows_on == rows_off
    _assert_same_weights(weights_on, weights_off)
