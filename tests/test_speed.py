"""Speed paths: exact fast paths (CPU arithmetic) and the apex selection with apex absent."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.layers import norms
from mptrain.layers.context import layer_context
from mptrain.layers.cross_entropy import vocab_parallel_cross_entropy
from mptrain.layers.random import ParamInit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import configs as bc  # noqa: E402

APEX = importlib.util.find_spec("apex") is not None


@pytest.mark.skipif(APEX, reason="checks the message when apex is absent")
@pytest.mark.parametrize("name", ["ApexFusedLayerNorm", "ApexFusedRMSNorm"])
def test_apex_norm_without_apex_is_one_config_error(name):
    with pytest.raises(ConfigError, match="normalization=ApexFused.*apex"):
        context = layer_context(ParallelConfig(), SimpleNamespace(tp_size=1),
                                init=ParamInit(seed=1, std=0.02, num_layers=1, device=torch.device("cpu")))
        norms.NORMALIZATIONS[name](16, eps=1e-5, context=context)


def test_apex_norms_keep_the_torch_params_and_specs():
    # same parameters and state-dict keys as the torch classes: checkpoints load either way
    assert issubclass(norms.ApexFusedLayerNorm, norms.LayerNorm) and issubclass(norms.ApexFusedRMSNorm, norms.RMSNorm)


def test_qkv_split_equals_the_slices_forward_and_backward():
    # attention.py: one torch.split instead of three slices; values and grads must be bit-equal
    s, b, ng, per, hn = 5, 3, 2, 4, 8
    base = torch.randn(s, b, ng * (per + 2) * hn, dtype=torch.float64)
    outs = []
    for split in (False, True):
        x = base.clone().requires_grad_(True)
        qkv = x.view(s, b, ng, per + 2, hn)
        if split:
            q, k, v = torch.split(qkv, [per, 1, 1], dim=3)
            q, k, v = q.reshape(s, b, ng * per, hn), k.squeeze(3), v.squeeze(3)
        else:
            q, k, v = qkv[:, :, :, :-2].reshape(s, b, ng * per, hn), qkv[:, :, :, -2], qkv[:, :, :, -1]
        w = torch.arange(1, 4, dtype=torch.float64)
        ((q ** 2).sum() * w[0] + (k ** 3).sum() * w[1] + (v * 0.5).sum() * w[2]).backward()
        outs.append((q.detach(), k.detach(), v.detach(), x.grad))
    for a, c in zip(*outs):
        assert torch.equal(a, c)


def test_cross_entropy_amax_matches_log_softmax():
    logits = torch.randn(7, 3, 40, requires_grad=True)  # the loss is computed in fp32
    target = torch.randint(0, 37, (7, 3))
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=37)
    ref = torch.nn.functional.cross_entropy(logits[..., :37].reshape(-1, 37), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, rtol=1e-6, atol=1e-6)


def test_small_suite_rows_and_reference_env():
    cfgs = bc.suite("small", 1)
    assert [c.name for c in cfgs] == ["s_6x384_v65_s256_mb64_do0.2", "s_6x384_v65_s256_mb64", "s_gpt124m_s1024_mb12_do0.1",
                                      "s_gpt11m_s256_mb64", "s_gpt124m_s1024_mb12", "s_gpt1.3b_mb4x4", "s_gpt350m_mb8",
                                      "s_6x384_v257_s256_mb64_do0.2_real", "s_gpt6.7b_full_mb1x16",
                                      "s_gpt1.3b_mb8x2", "s_gpt1.3b_mb16x1", "s_gpt1.3b_mb16x4"]
    # the table's splits of one global batch (16 × 2048 tokens), and the larger batch of 64 sequences
    assert {c.name: c.global_batch_size for c in cfgs if c.model == "gpt_1.3b"} == {
        "s_gpt1.3b_mb4x4": 16, "s_gpt1.3b_mb8x2": 16, "s_gpt1.3b_mb16x1": 16, "s_gpt1.3b_mb16x4": 64}
    small = next(c for c in cfgs if c.name == "s_gpt11m_s256_mb64")
    assert (small.shape.num_layers, small.shape.hidden_size, small.preset) == (6, 384, "gpt_125m")
    o = bc.mptrain_overrides(small, "compile", "/tmp/x")
    assert "model=gpt_125m" in o and "model.num_layers=6" in o and "model.seq_length=256" in o
    env = bc.reference_env(small)
    assert (env["LAYERS"], env["HIDDEN"], env["SEQ"], env["MBS"], env["CLIP"]) == ("6", "384", "256", "64", "1.0")
    # the dropout row: the same dropout and vocabulary on both sides of the comparison
    char = next(c for c in cfgs if c.name == "s_6x384_v65_s256_mb64_do0.2")
    o = bc.mptrain_overrides(char, "default", "/tmp/x")
    assert {"model.hidden_dropout=0.2", "model.attention_dropout=0.2", "data.vocab_size=65", "model.vocab_size=65"} <= set(o)
    assert not any(item.startswith("model.compile_layers") for item in o)  # the plain command
    env = bc.reference_env(char)
    assert (env["DROPOUT"], env["VOCAB"]) == ("0.2", "65")
    # the real-data pair: the same model on mock data and on the shipped corpus (byte tokenizer, 257 ids)
    real = next(c for c in cfgs if c.name == "s_6x384_v257_s256_mb64_do0.2_real")
    mock, corpus = (bc.mptrain_overrides(real, v, "/tmp/x") for v in ("default", "default_real"))
    assert {"data=mock", "data.vocab_size=257", "model.vocab_size=257"} <= set(mock)
    assert "data=shakespeare" in corpus and "model.vocab_size=257" in corpus
    assert not any(item.startswith(("data=mock", "data.vocab_size")) for item in corpus)
    assert [item for item in mock if item not in corpus] == ["data=mock", "data.vocab_size=257"]
    big = next(c for c in cfgs if c.name == "s_gpt6.7b_full_mb1x16")
    assert {"model=gpt_6.7b", "model.recompute_granularity=full", "train.micro_batch_size=1",
            "train.global_batch_size=16"} <= set(bc.mptrain_overrides(big, "default", "/tmp/x"))
