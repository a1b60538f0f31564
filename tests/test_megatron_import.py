"""Megatron-LM checkpoints in (`python -m mptrain.export --import-megatron`).

The fixtures under tests/fixtures/megatron/ were written by megatron-core 0.16.1 itself
(tests/fixtures/megatron/make_checkpoints.py, which says how to run it again): a GPT-2-style model as torch_dist,
a Llama-style one (SwiGLU, GQA, tied) as the legacy format at tp2 pp2, and megatron-core's fp32 logits of a fixed
input for both. Imported, mptrain's logits equal megatron-core's at tp1, tp2 and pp2; the model config comes from
the saved ``args``; a run trains from the import; what cannot be imported is one line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from train_utils import read_rows, run_job

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"
CHECKPOINTS = {"gpt_torch_dist": "gpt", "llama_legacy": "llama"}
REFERENCE = torch.load(FIXTURES / "logits.pt")  # {"tokens": [1, 32], "llama" / "gpt": [1, 32, 128] fp32}


def _cli(*args: str) -> int:
    from mptrain.export import main

    return main(list(args))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    """{fixture name: the imported checkpoint folder}, through the command line."""
    root = tmp_path_factory.mktemp("megatron")
    for name in CHECKPOINTS:
        assert _cli("--import-megatron", str(FIXTURES / name), "--output", str(root / name)) == 0
    return {name: root / name for name in CHECKPOINTS}


def _tp1_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a tp1pp1 model built in this process from the checkpoint (no torch.distributed)."""
    from mptrain.checkpoint.offline import load_full_state, model_config_from_dict, single_rank_groups
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks

    state, meta = load_full_state(str(ckpt))
    model = build_model_chunks(model_config_from_dict(meta["config"]["model"]), ParallelConfig(), single_rank_groups(),
                               vocab_size=int(meta["vocab_size"]))[0].eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p[: state[name].shape[0]].copy_(state[name])  # bf16 values, exactly in fp32
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :int(meta["vocab_size"])]


def _layouts_task(rank: int, world: int, ckpt: str, ids: torch.Tensor) -> dict:
    """{"tp2pp1": logits [b, s, V] (every rank), "tp1pp2": on the last stage (None on rank 0)}, each layout resharded
    from the import by training's own load."""
    from layout_logits import layout_logits

    return layout_logits(ckpt, ids)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_equal_megatron_core(imported, name):
    ids, want = REFERENCE["tokens"], REFERENCE[CHECKPOINTS[name]]
    # fp32 on the same (bf16) weights, the same math in another summation order: 1e-5 on O(1) logits
    torch.testing.assert_close(_tp1_logits(imported[name], ids), want, rtol=0, atol=1e-5)
    results = run_distributed(_layouts_task, 2, str(imported[name]), ids)
    torch.testing.assert_close(results[0]["tp2pp1"], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(results[1]["tp1pp2"], want, rtol=0, atol=1e-5)  # the last stage holds the logits


def test_the_model_comes_from_the_saved_args(imported):
    llama = json.loads((imported["llama_legacy"] / "iter_0000000" / "meta.json").read_text())
    gpt = json.loads((imported["gpt_torch_dist"] / "iter_0000000" / "meta.json").read_text())
    assert (llama["iteration"], llama["param_dtype"], llama["vocab_size"]) == (0, "bfloat16", 128)
    assert llama["config"]["checkpoint"] == {"use_checkpoint_args": True} and "data" not in llama["config"]
    assert llama["megatron"] == {"format": "torch", "iteration": 10, "checkpoint_version": 3.0, "tp": 2, "pp": 2,
                                 "vpp": None}
    assert gpt["megatron"] == {"format": "torch_dist", "iteration": 10, "checkpoint_version": 3.0, "tp": 1, "pp": 1,
                               "vpp": None}
    shared = {"name": "megatron", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
              "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 128, "make_vocab_size_divisible_by": 64,
              "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02, "layernorm_epsilon": 1e-5,
              "apply_layernorm_1p": False, "rotary_base": 10000, "rotary_percent": 1.0, "rope_scaling": False,
              "rope_scaling_factor": 8.0, "add_qkv_bias": False, "qk_layernorm": False, "kv_channels": None}
    assert llama["config"]["model"] == {**shared, "num_query_groups": 2, "untie_embeddings_and_output_weights": False,
                                        "normalization": "RMSNorm", "activation": "swiglu",
                                        "position_embedding_type": "rope", "add_bias_linear": False}
    assert gpt["config"]["model"] == {**shared, "num_query_groups": None, "untie_embeddings_and_output_weights": True,
                                      "normalization": "LayerNorm", "activation": "gelu",
                                      "position_embedding_type": "learned_absolute", "add_bias_linear": True}


def test_training_from_an_import(imported, tmp_path):
    """A run loads the import (use_checkpoint_args: Megatron's model at tp1pp2) and trains 2 steps from it."""
    ckpt = imported["llama_legacy"]
    run_distributed(run_job, 2, ["parallel=tp1pp2", f"checkpoint.load={ckpt}", "data.vocab_size=128",
                                 "model.seq_length=16", "train.train_iters=2", "train.global_batch_size=4",
                                 "train.micro_batch_size=2", "train.eval_interval=null", "optim.lr=1e-2",
                                 f"run.dir={tmp_path / 'run'}", f"checkpoint.save={tmp_path / 'ckpt'}"])
    rows = read_rows(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2] and rows[1]["lm_loss"] < rows[0]["lm_loss"]
    saved = json.loads((tmp_path / "ckpt" / "iter_0000002" / "meta.json").read_text())["config"]["model"]
    assert (saved["num_query_groups"], saved["activation"], saved["hidden_size"]) == (2, "swiglu", 32)


def test_the_saved_args_are_read_without_megatron(imported):
    """megatron-core's enums in the Namespace come back as stand-ins naming them; nothing of megatron is imported."""
    import sys

    from mptrain.megatron_ckpt.pickles import Opaque, load_pickle

    common = load_pickle(FIXTURES / "gpt_torch_dist" / "iter_0000010" / "common.pt")
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and (args.num_layers, args.swiglu, args.params_dtype) == (
        2, False, torch.bfloat16)
    assert isinstance(args.attention_backend, Opaque)
    assert args.attention_backend.dotted == "megatron.core.transformer.enums.AttnBackend"
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)


class _Runs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


def test_a_pickle_runs_nothing(tmp_path):
    from mptrain.megatron_ckpt.pickles import Opaque, load_pickle

    torch.save({"args": argparse.Namespace(num_layers=2), "payload": _Runs(str(tmp_path / "made"))}, tmp_path / "x.pt")
    state = load_pickle(tmp_path / "x.pt")
    assert not (tmp_path / "made").exists() and isinstance(state["payload"], Opaque)
    assert state["payload"].dotted == "posix.mkdir" and state["payload"].args == (str(tmp_path / "made"),)


def _rewrite_legacy(src: Path, dst: Path, edit) -> None:
    """A copy of the legacy fixture with ``edit(state)`` applied to each rank's dict (its args less megatron's enums,
    which are read as stand-ins that do not pickle again)."""
    from mptrain.megatron_ckpt.pickles import Opaque, load_pickle

    shutil.copytree(src, dst)
    for path in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_pickle(path, mmap=False)
        state["args"] = argparse.Namespace(**{k: v for k, v in vars(state["args"]).items() if not isinstance(v, Opaque)})
        edit(state)
        torch.save(state, path)


def test_virtual_pipeline_chunks_are_ordered_by_stage_then_rank(imported, tmp_path):
    """Legacy files of pp2 vpp2 (``model0`` / ``model1`` per rank): global layers (v0, p0), (v0, p1), (v1, p0),
    (v1, p1), Megatron's interleaved assignment. Made from the fixture's ranks: its layer 0 (stage 0) and layer 1
    (stage 1) each used twice, so a 4-layer model whose layer i is the fixture's layer i % 2."""
    from mptrain.checkpoint.offline import load_full_state
    from mptrain.megatron_ckpt.pickles import Opaque, load_pickle

    src = FIXTURES / "llama_legacy" / "iter_0000010"
    for t in range(2):
        stages = [load_pickle(src / f"mp_rank_0{t}_00{p}" / "model_optim_rng.pt", mmap=False) for p in range(2)]
        args = argparse.Namespace(**{k: v for k, v in vars(stages[0]["args"]).items() if not isinstance(v, Opaque)})
        args.num_layers, args.virtual_pipeline_model_parallel_size = 4, 2
        layer_only = [{k: v for k, v in st["model"].items() if k.startswith("decoder.layers.")} for st in stages]
        chunks = {0: (stages[0]["model"], layer_only[0]), 1: (layer_only[1], stages[1]["model"])}  # {p: (v0, v1)}
        for p, (v0, v1) in chunks.items():
            folder = tmp_path / "vpp" / "iter_0000010" / f"mp_rank_0{t}_00{p}"
            folder.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model0": v0, "model1": v1},
                       folder / "model_optim_rng.pt")
    (tmp_path / "vpp" / "latest_checkpointed_iteration.txt").write_text("10")
    assert _cli("--import-megatron", str(tmp_path / "vpp"), "--output", str(tmp_path / "out")) == 0
    got, meta = load_full_state(str(tmp_path / "out"))
    want, _ = load_full_state(str(imported["llama_legacy"]))
    assert meta["megatron"]["vpp"] == 2 and meta["config"]["model"]["num_layers"] == 4
    for name, tensor in got.items():
        layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
        ref = name if layer is None else name.replace(f"layers.{layer}.", f"layers.{int(layer) % 2}.")
        assert torch.equal(tensor, want[ref]), name


def test_the_import_says_what_starts_fresh(tmp_path, capsys):
    assert _cli("--import-megatron", str(FIXTURES / "gpt_torch_dist"), "--output", str(tmp_path / "out")) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: the optimizer state, LR schedule, loss scaler and consumed samples start fresh (the import "
                   "is iteration 0, as Megatron's --finetune loads a checkpoint); Megatron's iteration 10 is recorded "
                   "in meta.json",
                   "note: the tokenizer (--tokenizer-type NullTokenizer) is not carried: give the training run its "
                   "data.tokenizer (docs/MEGATRON.md)"]


TE = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
      "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def test_transformer_engine_names(imported, tmp_path):
    """Transformer Engine's layer spec fuses the norms into the next linear (``linear_qkv.layer_norm_weight``) and
    keeps an ``_extra_state`` per module: imported as the local spec's names."""
    from mptrain.checkpoint.offline import load_full_state

    def to_te(state):
        model = state["model"]
        for name in list(model):
            for ours, te in TE.items():
                if name.endswith(ours):
                    model[name.replace(ours, te)] = model.pop(name)
        model["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    _rewrite_legacy(FIXTURES / "llama_legacy", tmp_path / "te", to_te)
    assert _cli("--import-megatron", str(tmp_path / "te"), "--output", str(tmp_path / "out")) == 0
    want, _ = load_full_state(str(imported["llama_legacy"]))
    got, _ = load_full_state(str(tmp_path / "out"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def _one_line(capsys, *args: str) -> str:
    assert _cli(*args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: import-megatron: "), err
    return err


def test_query_key_norms_are_imported(imported, tmp_path):
    """--qk-layernorm: each layer's q_layernorm / k_layernorm [hn] (replicated over TP: rank 0's copy) are
    model.qk_layernorm's weights under the same names; the other tensors as without them."""
    from mptrain.checkpoint.offline import load_full_state

    norms = {"q": torch.linspace(0.5, 1.5, 8), "k": torch.linspace(1.5, 0.5, 8)}  # hn = kv_channels 8

    def qk_norm(state):
        state["args"].qk_layernorm = True
        for name in [n for n in state["model"] if n.endswith("self_attention.linear_qkv.weight")]:
            for p, weight in norms.items():
                state["model"][name.replace("linear_qkv.weight", f"{p}_layernorm.weight")] = weight.clone()
    _rewrite_legacy(FIXTURES / "llama_legacy", tmp_path / "qk", qk_norm)
    assert _cli("--import-megatron", str(tmp_path / "qk"), "--output", str(tmp_path / "out")) == 0
    got, meta = load_full_state(str(tmp_path / "out"))
    assert meta["config"]["model"]["qk_layernorm"] is True
    want, _ = load_full_state(str(imported["llama_legacy"]))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(set(got) - set(want)) == [f"decoder.layers.{i}.self_attention.{p}_layernorm.weight"
                                            for i in range(2) for p in ("k", "q")]
    assert all(torch.equal(got[f"decoder.layers.{i}.self_attention.{p}_layernorm.weight"], norms[p])
               for i in range(2) for p in "qk")


def test_what_cannot_be_imported_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "out")

    def qk_l2_norm(state):
        state["args"].qk_l2_norm = True
    _rewrite_legacy(FIXTURES / "llama_legacy", tmp_path / "qk", qk_l2_norm)
    assert "trained with --qk-l2-norm (qk_l2_norm=True): mptrain's query / key norm is model.qk_layernorm's" in _one_line(
        capsys, "--import-megatron", str(tmp_path / "qk"), "--output", out)
    shutil.copytree(FIXTURES / "llama_legacy", tmp_path / "partial")
    shutil.rmtree(tmp_path / "partial" / "iter_0000010" / "mp_rank_01_001")
    assert "lacks ['mp_rank_01_001/model_optim_rng.pt'] of its 2 x 2 (tp x pp) ranks" in _one_line(
        capsys, "--import-megatron", str(tmp_path / "partial"), "--output", out)
    assert "is not a checkpoint (iterations in" in _one_line(
        capsys, "--import-megatron", str(FIXTURES / "gpt_torch_dist"), "--iteration", "5", "--output", out)
    assert "holds no latest_checkpointed_iteration.txt" in _one_line(
        capsys, "--import-megatron", str(tmp_path), "--output", out)
    assert not Path(out).exists()


def test_checkpoint_load_of_a_megatron_folder_says_to_import_it():
    from mptrain.checkpoint.atomic import load_refusal

    folder = str(FIXTURES / "gpt_torch_dist")
    line = (f"checkpoint.load={folder} is a Megatron-LM checkpoint (latest_checkpointed_iteration.txt); import it "
            f"once with python -m mptrain.export --import-megatron {folder} --output CKPT, then set checkpoint.load=CKPT")
    assert load_refusal(folder, None) == line and load_refusal(folder, None, save=folder) == line


def test_gpt2_bpe_tokenizer_comes_with_its_files_or_a_note(tmp_path):
    """GPT2BPETokenizer: the node of the checkpoint's --vocab-file / --merge-file where both exist here; else a note."""
    import argparse

    from mptrain.megatron_ckpt.args import tokenizer_from_args

    bpe = Path(__file__).resolve().parent / "fixtures" / "gpt2_bpe"
    vocab, merges = str(bpe / "vocab.json"), str(bpe / "merges.txt")
    notes = []
    args = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tokenizer_from_args(args, notes) == {"_target_": "mptrain.data.tokenizers.GPT2BPETokenizer",
                                                "vocab_file": vocab, "merge_file": merges}
    assert notes == []
    gone = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=merges)
    assert tokenizer_from_args(gone, notes) is None
    assert notes == [f"the tokenizer (--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/v.json --merge-file "
                     f"{merges}) is not carried (its files are not on this machine): give the training run its "
                     "data.tokenizer (docs/MEGATRON.md)"]
