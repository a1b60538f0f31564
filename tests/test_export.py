"""`python -m mptrain.export`: consolidated safetensors, Hugging Face GPT-2 export, GPT-2 import.

The consolidated export must equal the layout-independent full tensors exactly (it is a copy);
the GPT-2 round trip (export → import) must be exact too (transposes and row regrouping only).
The `transformers` checks (transformers is a dev dependency) also cover the tokenizer files,
eos/bos ids and file modes of the HF export.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from procs import run_python
from test_checkpoint import VOCAB, _full, _save_task
from train_utils import read_rows, run_job

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=64", f"data.vocab_size={VOCAB}"]


def _cli(*args) -> subprocess.CompletedProcess:
    return run_python(["-m", "mptrain.export", *args], cwd=REPO, timeout=120)  # a real child process


@pytest.fixture(scope="module")
def synthetic_ckpt(tmp_path_factory) -> Path:
    """The synthetic state of test_checkpoint saved at tp2pp2 fp16 (tied embedding, padded vocab, main params)."""
    root = tmp_path_factory.mktemp("ckpt")
    run_distributed(_save_task, 4, str(root), ["parallel=tp2pp2", "precision=fp16"], 2, 2)
    return root


def test_consolidated_export_is_exact_and_loads_without_distributed(synthetic_ckpt, tmp_path):
    from safetensors.torch import load_file

    from mptrain.checkpoint.offline import load_consolidated
    from mptrain.layers.sharding import collect_shard_specs, take_shard

    out = tmp_path / "export"
    proc = _cli("--checkpoint", str(synthetic_ckpt), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    state = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["iteration"] == 6 and config["vocab_size"] == VOCAB and config["model"]["num_layers"] == 4
    assert "output_layer.weight" not in state  # tied: the last stage's copy is not a separate weight
    assert tuple(state["embedding.word_embeddings.weight"].shape) == (VOCAB, 32)  # unpadded
    assert len(state) == 2 + 4 * 12 + 2  # embeddings, 12 tensors per layer, final norm
    for name, tensor in state.items():
        # fp32 master weights (main/), not the fp16 copies: bitwise the synthetic full tensor
        assert tensor.dtype == torch.float32 and torch.equal(tensor, _full(f"main/{name}", tuple(tensor.shape))), name
    assert not dist.is_initialized()
    model = load_consolidated(str(out))
    assert not dist.is_initialized()
    specs = collect_shard_specs(model)
    for name, param in model.named_parameters():
        d = specs[name].partition_dim
        assert torch.equal(param.data, take_shard(state[name], specs[name], None if d is None else param.shape[d]))
    assert model.embedding.word_embeddings.weight.shape[0] == 128  # padded at tp1 (d=64), rows 100.. zero
    assert model.embedding.word_embeddings.weight[VOCAB:].abs().sum() == 0


def test_hf_gpt2_export_import_round_trip(synthetic_ckpt, tmp_path):
    from mptrain.checkpoint.offline import load_full_state

    hf_dir, back = tmp_path / "hf", tmp_path / "imported"
    proc = _cli("--checkpoint", str(synthetic_ckpt), "--output", str(hf_dir), "--format", "hf-gpt2")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["vocab_size"], cfg["n_positions"]) == (4, 32, 4, VOCAB, 16)
    # never imported (mock data, NullTokenizer: EOD = VOCAB - 1): bos = eos = the EOD that separated its documents
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (VOCAB - 1, VOCAB - 1)
    assert cfg["dtype"] == "float32" and "torch_dtype" not in cfg  # the key transformers 5 writes, as --format hf
    from mptrain.checkpoint.offline import atomic_meta, checkpoint_folder
    from mptrain.hf.convert import export_hf

    assert "hf" not in atomic_meta(checkpoint_folder(str(synthetic_ckpt)))
    export_hf(str(synthetic_ckpt), str(tmp_path / "hf-any"))  # --format hf: the same family and ids
    cfg_any = json.loads((tmp_path / "hf-any" / "config.json").read_text())
    param_dtype = atomic_meta(checkpoint_folder(str(synthetic_ckpt)))["param_dtype"]
    assert param_dtype == "float16" and cfg_any["dtype"] == param_dtype and "torch_dtype" not in cfg_any
    gen_any = json.loads((tmp_path / "hf-any" / "generation_config.json").read_text())
    assert (cfg_any["model_type"], cfg_any["bos_token_id"], cfg_any["eos_token_id"]) == ("gpt2", VOCAB - 1, VOCAB - 1)
    assert (gen_any["bos_token_id"], gen_any["eos_token_id"], gen_any["pad_token_id"]) == (VOCAB - 1,) * 3
    proc = _cli("--import-hf-gpt2", str(hf_dir), "--output", str(back))
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint.load=" in proc.stdout and (back / "latest").read_text().strip() == "0"
    original, _ = load_full_state(str(synthetic_ckpt))
    imported, meta = load_full_state(str(back))
    assert meta["iteration"] == 0 and sorted(imported) == sorted(original)
    for name in original:
        assert torch.equal(imported[name], original[name].float()), name


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["safetensors", "hf", "hf-gpt2"])
def test_export_verifies_the_manifest_and_writes_nothing_from_a_corrupt_shard(synthetic_ckpt, tmp_path, capsys, fmt):
    """A flipped byte in a shard: one error line naming the file, exit 1, no --output; without manifest.json
    (a folder saved before manifests) the same folder exports."""
    import shutil
    import zlib

    from mptrain.export import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(synthetic_ckpt, ckpt)
    folder = ckpt / f"iter_{int((ckpt / 'latest').read_text()):07d}"
    shard = sorted(folder.glob("__*.distcp"))[-1]
    want = json.loads((folder / "manifest.json").read_text())["files"][shard.name]["crc32"]
    _flip_byte(shard)
    got = f"{zlib.crc32(shard.read_bytes()) & 0xFFFFFFFF:08x}"
    assert main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "out"), "--format", fmt]) == 1
    assert capsys.readouterr().err == (f"error: --checkpoint: {shard} is corrupt (crc32 {got}, the manifest says "
                                       f"{want}); restore the file from an intact copy of the checkpoint, or read "
                                       "another saved iteration (--iteration N)\n")
    assert not (tmp_path / "out").exists()
    if fmt == "safetensors":  # an older folder (no manifest) is read unverified, as training reads it
        (folder / "manifest.json").unlink()
        assert main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "old")]) == 0
        assert (tmp_path / "old" / "model.safetensors").is_file()


def test_hf_gpt2_export_refuses_other_architectures(tmp_path):
    run_distributed(run_job, 1, SMALL + ["model.normalization=RMSNorm", "model.activation=swiglu", "train.train_iters=1",
                                         f"run.dir={tmp_path / 'run'}", f"checkpoint.save={tmp_path / 'ckpt'}"])
    proc = _cli("--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--format", "hf-gpt2")
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: export --format hf-gpt2: the model is not a GPT-2: "
                                   "model.normalization='RMSNorm' (GPT-2: 'LayerNorm'), "
                                   "model.activation='swiglu' (GPT-2: 'gelu'); use --format hf (Llama / Mistral / Qwen2 / "
                                   "Qwen3 / Mixtral / Qwen3-MoE) or --format safetensors")


def test_imported_gpt2_is_a_training_starting_point(tmp_path):
    """Train 2 steps, export to GPT-2, import, train from it: iteration 1's loss is the trained model's loss."""
    ckpt = tmp_path / "ckpt"
    run_distributed(run_job, 2, SMALL + ["parallel=tp2pp1", "train.train_iters=2", f"run.dir={tmp_path / 'a'}",
                                         f"checkpoint.save={ckpt}"])
    assert _cli("--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), "--format", "hf-gpt2").returncode == 0
    assert _cli("--import-hf-gpt2", str(tmp_path / "hf"), "--output", str(tmp_path / "imp")).returncode == 0
    # the imported checkpoint is iteration 0: the new run reads the data from the start, i.e. the
    # iteration-1 batch the original run saw with its random init
    run_distributed(run_job, 1, SMALL + ["train.train_iters=1", f"run.dir={tmp_path / 'b'}",
                                         f"checkpoint.load={tmp_path / 'imp'}"])
    log = (tmp_path / "b" / "train.log").read_text()
    assert "loaded iteration 0" in log
    rows = read_rows(tmp_path / "b")
    assert [r["iteration"] for r in rows] == [1]
    fresh = read_rows(tmp_path / "a")[0]["lm_loss"]  # iteration 1 of the original run, from the random init
    assert rows[0]["lm_loss"] < fresh  # the imported (trained) weights fit the same batch better than the init


def test_transformers_loads_and_generates(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mptrain.checkpoint.offline import load_consolidated

    ckpt = tmp_path / "ckpt"
    run_distributed(run_job, 2, SMALL + ["parallel=tp2pp1", "train.train_iters=3", f"run.dir={tmp_path / 'run'}",
                                         f"checkpoint.save={ckpt}"])
    assert _cli("--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), "--format", "hf-gpt2").returncode == 0
    assert _cli("--checkpoint", str(ckpt), "--output", str(tmp_path / "st")).returncode == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ours = load_consolidated(str(tmp_path / "st")).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids, torch.arange(16).expand(2, 16))[..., :VOCAB]  # [b, s, V_pad] -> real vocab
        got = hf(ids).logits
    # fp32, same math; HF's attention kernel differs from SDPA's summation order: 1e-4 absolute on O(1) logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    prompt = ids[:, :4]
    out = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(6):  # our greedy decoding, full recompute per token
            logits = ours(seq, torch.arange(seq.shape[1]).expand(seq.shape[0], -1))[:, -1, :VOCAB]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


BYTE = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
        "data.vocab_size=200", "data.tokenizer._target_=mptrain.data.tokenizers.ByteTokenizer",
        "~data.tokenizer.vocab_size"]


def test_hf_export_with_the_byte_tokenizer_loads_in_transformers_as_is(tmp_path):
    """Tokenizer files (an exact byte-level tokenizer), eos/bos ids, normal file modes."""
    transformers = pytest.importorskip("transformers")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    run_distributed(run_job, 1, BYTE + ["train.train_iters=1", f"run.dir={tmp_path / 'run'}", f"checkpoint.save={ckpt}"])
    proc = _cli("--checkpoint", str(ckpt), "--output", str(out), "--format", "hf-gpt2")
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]
    for p in out.iterdir():
        assert p.stat().st_mode & 0o777 == 0o644, p.name  # umask 022 here (not the 0600 of a private temp file)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (256, 256, 257)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (256, 256)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert model.generation_config.eos_token_id == 256 and tok.eos_token_id == 256 and tok.bos_token_id == 256
    from mptrain.data.tokenizers import ByteTokenizer

    ours = ByteTokenizer()
    for text in ("Hello, world!\n", "  two  spaces\tand tabs", "héllo wörld — ünïcode ✓ 日本", ""):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text) == list(text.encode("utf-8")), text
        assert tok.decode(ids) == ours.decode(ids) == text
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == ours.decode([104, 105, 256]) == "hi"
    assert tok.decode([0xC3]) == ours.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence: replaced alike


def test_hf_export_copies_an_hf_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mptrain.data.tokenizers import HFTokenizer
    from mptrain.hf.tokenizer import write_tokenizer_files

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n"
                              for i in range(50)))
    tj = tmp_path / "tok.json"
    proc = run_python(["-m", "mptrain.data.train_tokenizer", "--input", str(corpus), "--vocab-size", "300", "--output",
                       str(tj)], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    spec = {"_target_": "mptrain.data.tokenizers.HFTokenizer", "tokenizer_json": str(tj)}
    out = tmp_path / "hf"
    out.mkdir()
    eod, written, notes = write_tokenizer_files({"name": "indexed", "tokenizer": spec}, out, model_max_length=64)
    ours = HFTokenizer(str(tj))
    assert eod == ours.eod and not notes and (out / "tokenizer.json").read_bytes() == tj.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "the lazy fox jumps 42 times"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(text) and tok.decode(ids) == ours.decode(ids) and tok.eos_token_id == ours.eod


@pytest.mark.parametrize("overrides, fmt, message", [
    (["model.apply_layernorm_1p=true"], "hf-gpt2",
     "error: export --format hf-gpt2: the model is not a GPT-2: model.apply_layernorm_1p=True (GPT-2: False); use "
     "--format hf (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE) or --format safetensors"),
    (["model.normalization=RMSNorm", "model.activation=swiglu", "model.position_embedding_type=rope",
      "model.rotary_percent=0.5", "model.add_bias_linear=false"], "hf",
     "error: export --format hf: no Hugging Face family expresses the model (GPT-2: model.normalization='RMSNorm' "
     "(GPT-2: 'LayerNorm'), model.activation='swiglu' (GPT-2: 'gelu'), model.position_embedding_type='rope' (GPT-2: "
     "'learned_absolute'), model.add_bias_linear=False (GPT-2: True); Llama: model.rotary_percent=0.5 (Llama: 1.0); Mistral: model.rotary_percent=0.5 (Mistral: "
     "1.0); Qwen2: model.rotary_percent=0.5 (Qwen2: 1.0), model.add_bias_linear=False, add_qkv_bias=False (Qwen2: "
     "biases on qkv); Qwen3: model.rotary_percent=0.5 (Qwen3: 1.0), model.qk_layernorm=False (Qwen3: True); Mixtral: "
     "model.rotary_percent=0.5 (Mixtral: 1.0), model.num_moe_experts=None (Mixtral: experts); Qwen3-MoE: "
     "model.rotary_percent=0.5 (Qwen3-MoE: 1.0), model.qk_layernorm=False (Qwen3-MoE: True), model.num_moe_experts=None "
     "(Qwen3-MoE: experts)); use --format safetensors"),
])
def test_hf_export_refuses_layernorm_1p_and_partial_rope(tmp_path, overrides, fmt, message):
    """What no family's config.json can say is refused before anything is written: LayerNorm weights stored as
    gamma - 1 (apply_layernorm_1p), RoPE on part of each head (rotary_percent < 1)."""
    run_distributed(run_job, 1, SMALL + overrides + ["train.train_iters=1", f"run.dir={tmp_path / 'run'}",
                                                     f"checkpoint.save={tmp_path / 'ckpt'}"])
    proc = _cli("--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--format", fmt)
    assert proc.returncode == 1
    assert proc.stderr.strip() == message
    assert not (tmp_path / "hf").exists()
