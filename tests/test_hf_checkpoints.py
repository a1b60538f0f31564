"""Hugging Face checkpoints in and out (`python -m mptrain.export --import-hf` / `--format hf`).

Each family is a tiny random model built by `transformers` from a config (no download): Llama with
tied embeddings and the llama3 RoPE scaling (rope_theta 500000), Llama untied, Mistral (saved in
bf16, head dim 16 = 2 x hidden / heads), Qwen2 with its QKV bias (saved as several safetensors shards),
Qwen3 (query / key norms, head dim 16), GPT-2 (the MoE families: test_hf_moe.py). Shapes: 2 layers, hidden 32, 4 query heads in 2 K/V groups (GQA; GPT-2 multi-head), vocab 100
(padded to 128 / 256).
Imported, mptrain's logits equal transformers' at tp1, tp2 and pp2; greedy decoding equals
`generate`; export after import gives back the same tensors (keys, shapes, dtypes, values) and a
config `AutoModelForCausalLM` loads; training from an import is layout-independent and exports back.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from train_utils import compose, read_rows, run_job

transformers = pytest.importorskip("transformers")

VOCAB, EOS = 100, 99
SEQ = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=EOS)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
    "llama_tied_llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama_untied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)),
    "mistral_bf16": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=None, head_dim=16)),
    "qwen2_sharded": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function="gelu",
        bos_token_id=0, eos_token_id=EOS)),
}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"
TOKENIZER_CONFIG = {"eos_token": "</s>", "bos_token": "t0", "pad_token": "t1", "model_max_length": 48,
                    "chat_template": TEMPLATE}
IDS = torch.randint(0, VOCAB - 1, (2, SEQ), generator=torch.Generator().manual_seed(0))
PROMPT = [5, 6, 7, 8]


def _tokenizer_json(path: Path) -> None:
    """A word-level tokenizer of VOCAB tokens ``t0 .. t98`` and ``</s>`` (EOS), with its tokenizer_config.json
    (a chat template, a model_max_length other than the positions, a pad token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"</s>": EOS}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))


def _make_hf(family: str, folder: Path) -> torch.nn.Module:
    """Save a random ``family`` model to ``folder``; returns it in fp32 (eval) with the saved values."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)  # not the init's ones / zeros
        model.get_output_embeddings().weight[EOS] = 0.0  # EOS never wins: greedy decoding runs its 8 tokens
        if family == "mistral_bf16":
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())  # the fp32 reference holds exactly the saved bf16 values
    # a bf16 copy (`.to` casts in place, the RoPE inv_freq buffer included)
    saved = copy.deepcopy(model).to(torch.bfloat16) if family == "mistral_bf16" else model
    saved.save_pretrained(folder, max_shard_size="20KB" if family == "qwen2_sharded" else "5GB")
    _tokenizer_json(folder)
    return model


def _cli(*args: str) -> int:
    from mptrain.export import main

    return main(list(args))


def import_families(root, families, make_hf) -> dict:
    """{family: (HF folder, checkpoint folder, the fp32 transformers model)}: each family's tiny model written under
    ``root`` by ``make_hf(family, folder)``, then imported through the CLI."""
    out = {}
    for family in families:
        model = make_hf(family, root / family)
        assert _cli("--import-hf", str(root / family), "--output", str(root / f"{family}-ckpt")) == 0
        out[family] = (root / family, root / f"{family}-ckpt", model)
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    """`import_families` of the dense families."""
    return import_families(tmp_path_factory.mktemp("hf"), FAMILIES, _make_hf)


def _read_safetensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _layouts_task(rank: int, world: int, ckpt: str, ids: torch.Tensor, prompt: list) -> dict:
    """{"tp2pp1": logits [b, s, V] (every rank), "tp1pp2": logits on the last stage (rank 1; None on rank 0),
    "generated": greedy new ids at tp2, "eod": the loaded tokenizer's EOD}; each layout resharded from the import."""
    from layout_logits import layout_logits

    from mptrain.generate import generate_ids, load_generator

    out = layout_logits(ckpt, ids)
    gen = load_generator(ckpt)  # tp = the world size, with the imported tokenizer's EOD
    try:
        out["generated"] = generate_ids(gen, prompt, max_new_tokens=8)
        out["eod"] = gen.tokenizer.eod
    finally:
        gen.groups.destroy()
    return out


def _tp1_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a tp1pp1 model built in this process from the checkpoint (no torch.distributed)."""
    from mptrain.config.parallel import ParallelConfig
    from mptrain.checkpoint.offline import load_full_state, model_config_from_dict
    from mptrain.checkpoint.offline import single_rank_groups as _single_rank_groups
    from mptrain.layers.gpt import build_model_chunks

    state, meta = load_full_state(str(ckpt))
    model = build_model_chunks(model_config_from_dict(meta["config"]["model"]), ParallelConfig(), _single_rank_groups(),
                               vocab_size=int(meta["vocab_size"]))[0].eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p[: state[name].shape[0]].copy_(state[name])  # padded vocab rows stay zero
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :int(meta["vocab_size"])]


def hf_reference(hf) -> tuple:
    """transformers' answers: (logits of `IDS` ``[1, len, V]``, the greedy tokens after `PROMPT` up to EOS, which
    ours leaves out as it stops at EOD)."""
    with torch.no_grad():
        logits = hf(IDS).logits
        new = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=EOS,
                          pad_token_id=EOS)[0, len(PROMPT):].tolist()
    return logits, new[: new.index(EOS)] if EOS in new else new


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_decoding_equal_transformers(imported, family):
    hf_dir, ckpt, hf = imported[family]
    want, hf_new = hf_reference(hf)
    # fp32, the same math in another summation order: 1e-5 on O(1) logits
    torch.testing.assert_close(_tp1_logits(ckpt, IDS), want, rtol=0, atol=1e-5)
    results = run_distributed(_layouts_task, 2, str(ckpt), IDS, PROMPT)
    torch.testing.assert_close(results[0]["tp2pp1"], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(results[1]["tp1pp2"], want, rtol=0, atol=1e-5)  # the last stage holds the logits
    assert results[0]["eod"] == EOS  # the tokenizer.json's EOS is the run's EOD
    assert results[0]["generated"] == hf_new and len(hf_new) > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_after_import_gives_back_the_same_tensors(imported, family, tmp_path):
    hf_dir, ckpt, hf = imported[family]
    shard_args = ["--max-shard-size-mb", "0.01"] if family == "qwen2_sharded" else []  # 10 kB: several shards
    assert _cli("--checkpoint", str(ckpt), "--output", str(tmp_path / "out"), "--format", "hf", *shard_args) == 0
    original, exported = _read_safetensors(hf_dir), _read_safetensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    if family == "qwen2_sharded":  # several files in and out, each listed by the index
        assert len(list(hf_dir.glob("model-*.safetensors"))) > 1
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1
    from mptrain.checkpoint.offline import atomic_meta, model_config_from_dict
    from mptrain.layers.params import count_parameters

    model = atomic_meta(next(ckpt.glob("iter_*")))["config"]["model"]
    # the parameter-count formula (metrics, planner) knows each family's biases and tie
    assert count_parameters(model_config_from_dict(model), vocab_size=VOCAB) == sum(p.numel() for p in hf.parameters())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == ("bfloat16" if family == "mistral_bf16" else "float32")
    # loaded in fp32 (bf16 weights upcast exactly), as the reference, so the logits are equal bitwise
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tokenizer.eos_token_id == EOS
    # the imported tokenizer_config.json comes back: its chat template, model_max_length, pad token
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "add_prefix_space": False,
        **TOKENIZER_CONFIG}
    assert (tokenizer.chat_template, tokenizer.model_max_length, tokenizer.pad_token_id) == (TEMPLATE, 48, 1)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


def _one_line_error(capsys, *args: str) -> str:
    assert _cli(*args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_inputs_are_one_line(imported, tmp_path, capsys):
    from mptrain.errors import ConfigError
    from mptrain.training.run import _validated

    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _one_line_error(capsys, "--import-hf", str(tmp_path / "empty"), "--output",
                                                   str(tmp_path / "a"))
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert "model_type='bert'" in _one_line_error(capsys, "--import-hf", str(bert), "--output", str(tmp_path / "b"))
    wrong = tmp_path / "wrong"
    shutil.copytree(imported["llama_untied"][0], wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    err = _one_line_error(capsys, "--import-hf", str(wrong), "--output", str(tmp_path / "c"))
    assert "mlp.gate_proj.weight [48, 32]" in err and "config.json implies [128, 32]" in err
    (wrong / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))
    assert "sliding_window=16" in _one_line_error(capsys, "--import-hf", str(wrong), "--output", str(tmp_path / "d"))
    # a K/V projection whose rows break the fused QKV layout itself
    (wrong / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(wrong / "model.safetensors"))
    k = "model.layers.0.self_attn.k_proj.weight"
    save_file({**weights, k: torch.cat([weights[k], weights[k][:1]])}, str(wrong / "model.safetensors"))
    err = _one_line_error(capsys, "--import-hf", str(wrong), "--output", str(tmp_path / "e"))
    assert f"{k} [{weights[k].shape[0] + 1}, 32]" in err and "the weights do not match config.json" in err
    # a truncated file
    data = (wrong / "model.safetensors").read_bytes()
    (wrong / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "cannot be read as safetensors" in _one_line_error(capsys, "--import-hf", str(wrong), "--output",
                                                              str(tmp_path / "f"))
    # an export option with an import would be ignored: refused, and nothing written
    llama = str(imported["llama_untied"][0])
    err = _one_line_error(capsys, "--import-hf", llama, "--output", str(tmp_path / "x"), "--dtype", "bfloat16",
                          "--format", "hf")
    assert "--format, --dtype apply to exports only" in err and not (tmp_path / "x").exists()
    err = _one_line_error(capsys, "--import-hf", llama, "--import-hf-gpt2", str(imported["gpt2"][0]), "--output",
                          str(tmp_path / "x"))
    assert "each import one folder" in err and not (tmp_path / "x").exists()
    # an existing checkpoint folder is never taken over, an earlier export never mixed with a new one
    ckpt = imported["llama_untied"][1]
    latest = (ckpt / "latest").read_text()
    err = _one_line_error(capsys, "--import-hf", str(imported["gpt2"][0]), "--output", str(ckpt))
    assert "is not an empty folder" in err and (ckpt / "latest").read_text() == latest
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    assert "is not an empty folder" in _one_line_error(capsys, "--checkpoint", str(ckpt), "--output", str(out),
                                                       "--format", "hf")
    assert (out / "model.safetensors").read_bytes() == b"x" and len(list(out.iterdir())) == 1
    # --hf-model-type names a Llama-family spelling: refused for GPT-2's architecture, and outside --format hf
    gpt2 = str(imported["gpt2"][1])
    err = _one_line_error(capsys, "--checkpoint", gpt2, "--output", str(tmp_path / "g"), "--format", "hf",
                          "--hf-model-type", "llama")
    assert "--hf-model-type=llama" in err and "exports as gpt2" in err and not (tmp_path / "g").exists()
    err = _one_line_error(capsys, "--checkpoint", gpt2, "--output", str(tmp_path / "g"), "--format", "hf-gpt2",
                          "--hf-model-type", "gpt2")
    assert "--hf-model-type=gpt2 applies to --format hf only" in err and not (tmp_path / "g").exists()
    assert _cli("--checkpoint", gpt2, "--output", str(tmp_path / "g"), "--format", "hf", "--hf-model-type", "gpt2") == 0
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == ("gpt2", 0, EOS)
    err = _one_line_error(capsys, "--checkpoint", str(ckpt), "--output", str(tmp_path / "h"), "--format", "hf",
                          "--hf-model-type", "gpt2")
    assert "--hf-model-type=gpt2" in err and not (tmp_path / "h").exists()
    for size in ("0", "-5"):
        err = _one_line_error(capsys, "--checkpoint", str(ckpt), "--output", str(tmp_path / "s"), "--format", "hf",
                              "--max-shard-size-mb", size)
        assert err == (f"error: export --max-shard-size-mb={size}: must be > 0 (MB per safetensors shard, default "
                       "5000); pass a positive size") and not (tmp_path / "s").exists()
    # the imported model (2 query groups) comes with checkpoint.load: tp 4 cannot split its K/V heads
    with pytest.raises(ConfigError, match=r"^model.num_query_groups=2 is not divisible by "
                                          r"parallel.tensor_model_parallel_size=4; [^\n]*$"):
        _validated(compose([f"checkpoint.load={ckpt}", "parallel=tp4pp1"]), 4)


def test_preprocessing_takes_the_imported_eod(imported):
    """`--tokenizer hf:PATH:EOD_TOKEN`: data preprocessed with the model's own EOS (not every tokenizer has
    <|endoftext|>)."""
    from mptrain.data.tokenizers import parse_cli_tokenizer
    from mptrain.errors import ConfigError

    path = imported["llama_untied"][0] / "tokenizer.json"
    assert parse_cli_tokenizer(f"hf:{path}:</s>").eod == EOS
    with pytest.raises(ConfigError) as err:
        parse_cli_tokenizer(f"hf:{path}")
    # the fix as the trainer's key (++: set or added) and as preprocess's flag, and the token the files name
    assert str(err.value) == (
        f"data.tokenizer.eod_token='<|endoftext|>' is not in the vocabulary of {path}; pass the tokenizer's "
        f"end-of-document token as ++data.tokenizer.eod_token=TOKEN (to mptrain.data.preprocess: --tokenizer "
        f"hf:{path}:TOKEN); tokenizer_config.json beside it names eos_token '</s>'")


def test_data_preprocessed_with_another_eod_is_refused(imported, tmp_path):
    """The same tokenizer file (one fingerprint) with another eod_token: the EOD id recorded beside the index
    differs from the tokenizer's, one line naming data.tokenizer.eod_token."""
    from mptrain.data.preprocess import preprocess
    from mptrain.data.tokenizers import HFTokenizer, check_tokenizer_record
    from mptrain.errors import ConfigError

    path = imported["llama_untied"][0] / "tokenizer.json"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"t{i} t{i + 1} t{i + 2}"}) + "\n" for i in range(5)))
    prefix = str(tmp_path / "d")
    preprocess([str(corpus)], output_prefix=prefix, tokenizer=HFTokenizer(str(path), "</s>"), workers=1,
               progress=False)
    assert json.loads(Path(prefix + ".tokenizer.json").read_text())["eod"] == EOS
    assert check_tokenizer_record(prefix, HFTokenizer(str(path), "</s>")) is True
    with pytest.raises(ConfigError) as err:
        check_tokenizer_record(prefix, HFTokenizer(str(path), "t5"))
    assert str(err.value) == (f"data.tokenizer: {prefix} was preprocessed with EOD id {EOS} but data.tokenizer's EOD "
                              f"is 5; set data.tokenizer.eod_token='</s>' (id {EOS}), or re-run `python -m "
                              "mptrain.data.preprocess ... --overwrite` with this tokenizer's EOD")
    # data=shakespeare preprocesses its corpus on first use: another EOD gets a cache of its own
    from mptrain.data.provider import ShakespeareDataProvider

    cache = tmp_path / "cache"
    for eod_token in ("</s>", "t5", "</s>"):
        provider = ShakespeareDataProvider(corpus=str(corpus), tokenizer=HFTokenizer(str(path), eod_token), seq_length=4,
                                           micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1,
                                           needs_data=True, split=[1, 0, 0], cache_dir=str(cache))
        assert next(provider.train_iterator(0))["tokens"].shape == (1, 4)
    records = {p.name: json.loads(p.read_text())["eod"] for p in cache.glob("*.tokenizer.json")}
    size = corpus.stat().st_size
    assert records == {f"c-{provider.tokenizer.fingerprint.replace(':', '_')}-{size}.tokenizer.json": EOS,
                       f"c-{provider.tokenizer.fingerprint.replace(':', '_')}-eod5-{size}.tokenizer.json": 5}


TRAIN = ["model.seq_length=16", f"data.vocab_size={VOCAB}", "train.train_iters=2", "train.global_batch_size=4",
         "train.micro_batch_size=2", "train.eval_interval=null", "optim.lr=1e-2"]


def test_training_from_an_import_is_layout_independent_and_exports(imported, tmp_path):
    """tp2pp2 from the imported Mistral (bf16 weights, fp32 training) equals tp1pp1 (DESIGN.md §3 tolerances);
    its export is a Mistral again and reproduces mptrain's logits in transformers."""
    ckpt = imported["mistral_bf16"][1]
    runs = {}
    for world, parallel in ((1, "tp1pp1"), (4, "tp2pp2")):
        save = [f"checkpoint.save={tmp_path / 'tp2pp2-ckpt'}"] if world == 4 else []  # only this one is exported
        run_distributed(run_job, world, TRAIN + [f"parallel={parallel}", f"checkpoint.load={ckpt}",
                                                 f"run.dir={tmp_path / parallel}", *save])
        runs[parallel] = read_rows(tmp_path / parallel)
    assert [r["iteration"] for r in runs["tp2pp2"]] == [1, 2]
    for a, b in zip(runs["tp1pp1"], runs["tp2pp2"]):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert runs["tp1pp1"][-1]["lm_loss"] < runs["tp1pp1"][0]["lm_loss"]  # it trains
    trained = tmp_path / "tp2pp2-ckpt"
    # the run's checkpoint keeps its own copy of the tokenizer file (it decodes after the import moves)
    assert (trained / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert json.loads((trained / "tokenizer_config.json").read_text()) == TOKENIZER_CONFIG  # and what describes it
    saved = json.loads(next(trained.glob("iter_*/meta.json")).read_text())["config"]
    assert saved["checkpoint"]["use_checkpoint_args"] is True and saved["model"]["kv_channels"] == 16
    # the import's config.json values travel with the model into the run's checkpoints
    assert saved["checkpoint"]["hf_config"] == {"model_type": "mistral", "bos_token_id": 0, "eos_token_id": EOS}
    assert _cli("--checkpoint", str(trained), "--output", str(tmp_path / "out"), "--format", "hf") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "MistralForCausalLM" and next(back.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, _tp1_logits(trained, IDS), rtol=0, atol=1e-5)
    # import -> train -> export gives the original bos / eos ids (not the EOD for both)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == ("mistral", 0, EOS)
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, EOS, EOS)
    # and the tokenizer files name the same tokens (AutoTokenizer's ids agree with config.json's)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("t0", "</s>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, EOS)
    # import -> train -> export keeps the imported tokenizer_config.json's fields
    assert (tokenizer.chat_template, tokenizer.model_max_length, tokenizer.pad_token) == (TEMPLATE, 48, "t1")
    # and a run resumed from the trained checkpoint carries them on
    from mptrain.checkpoint.args import apply_checkpoint_args
    from mptrain.config.schema import as_config

    cfg = apply_checkpoint_args(as_config(compose([f"checkpoint.load={trained}"])))
    assert cfg.checkpoint.hf_config == {"model_type": "mistral", "bos_token_id": 0, "eos_token_id": EOS}


def test_an_import_has_a_manifest_that_training_verifies(imported, tmp_path):
    """--import-hf writes manifest.json (size and CRC32 of every other file of the folder), so a run that
    loads the import refuses a flipped byte in one of its shards."""
    import zlib

    for family, (_, ckpt, _) in imported.items():
        folder = ckpt / "iter_0000000"
        manifest = json.loads((folder / "manifest.json").read_text())
        names = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
        assert manifest["algorithm"] == "crc32" and sorted(manifest["files"]) == names, family
        assert ".metadata" in names and "meta.json" in names and any(n.endswith(".distcp") for n in names)
        for name in names:
            data = (folder / name).read_bytes()
            assert manifest["files"][name] == {"bytes": len(data), "crc32": f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"}
    copy = tmp_path / "ckpt"
    shutil.copytree(imported["mistral_bf16"][1], copy)
    shard = sorted((copy / "iter_0000000").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match=rf"ConfigError: checkpoint.load={copy}: {shard} is corrupt \(crc32 "):
        run_distributed(run_job, 1, TRAIN + ["parallel=tp1pp1", f"checkpoint.load={copy}", f"run.dir={tmp_path / 'run'}"])


def test_a_moved_import_finds_its_tokenizer(imported, tmp_path):
    """The recorded tokenizer.json path is gone (the checkpoint folder moved): the copy beside it is used, by
    training, generation and export alike."""
    from mptrain.checkpoint.args import apply_checkpoint_args

    moved = tmp_path / "moved"
    shutil.copytree(imported["llama_untied"][1], moved)
    meta_path = next(moved.glob("iter_*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"]["tokenizer"]["tokenizer_json"] = str(tmp_path / "gone" / "tokenizer.json")
    meta_path.write_text(json.dumps(meta))
    from mptrain.config.schema import as_config

    cfg = apply_checkpoint_args(as_config(compose([f"checkpoint.load={moved}"])))
    assert cfg.data.tokenizer["tokenizer_json"] == str((moved / "tokenizer.json").resolve())
    assert cfg.model.num_query_groups == 2
    # generate and export read the same copy
    from mptrain.checkpoint.offline import atomic_meta

    saved = atomic_meta(meta_path.parent)["config"]["data"]["tokenizer"]
    assert saved["tokenizer_json"] == str((moved / "tokenizer.json").resolve())


def test_a_tokenizer_on_the_command_line_wins_over_the_checkpoints(imported, caplog, monkeypatch):
    """use_checkpoint_args takes the architecture (an architecture key on the command line: one warning); a
    data.tokenizer given on the command line stays, with one warning naming both (on rank 0 alone), and drops
    the imported bos/eos ids; checkpoint.hf_config comes from the import's meta.json."""
    from mptrain.checkpoint.args import apply_checkpoint_args
    from mptrain.config.schema import as_config

    ckpt = imported["llama_untied"][1]
    byte = ["data.tokenizer._target_=mptrain.data.tokenizers.ByteTokenizer", "~data.tokenizer.vocab_size"]
    overrides = [f"checkpoint.load={ckpt}", *byte]
    monkeypatch.setenv("RANK", "1")  # under torchrun every rank checks the config: rank 0 alone warns
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(overrides)), overrides)
    assert cfg.data.tokenizer == {"_target_": "mptrain.data.tokenizers.ByteTokenizer"} and not caplog.records
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(overrides)), overrides)
    assert cfg.data.tokenizer == {"_target_": "mptrain.data.tokenizers.ByteTokenizer"}
    assert cfg.model.num_query_groups == 2 and cfg.model.vocab_size == VOCAB  # the architecture is the checkpoint's
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "HFTokenizer" in lines[0] and "ByteTokenizer" in lines[0] and "using the command line's" in lines[0]
    # the imported bos/eos name tokens of the checkpoint's tokenizer: dropped, so an export writes the run's EOD
    assert cfg.checkpoint.hf_config == {"model_type": "llama", "bos_token_id": None, "eos_token_id": None}
    from mptrain.hf.convert import special_ids

    assert special_ids({"config": {"checkpoint": {"hf_config": cfg.checkpoint.hf_config}}}, 256) == (256, 256)
    # an architecture key on the command line: the checkpoint's wins, in one warning naming it
    caplog.clear()
    layers = [f"checkpoint.load={ckpt}", "model.num_layers=5"]
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(layers)), layers)
    lines = [r.getMessage() for r in caplog.records]
    assert cfg.model.num_layers == 2 and len(lines) == 1 and "model.num_layers=5 -> 2" in lines[0], lines
    assert cfg.checkpoint.hf_config == {"model_type": "llama", "bos_token_id": 0, "eos_token_id": EOS}
    # without a tokenizer on the command line: the checkpoint's, and no warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(overrides[:1])), overrides[:1])
    assert cfg.data.tokenizer["_target_"] == "mptrain.data.tokenizers.HFTokenizer" and not caplog.records


def test_tokenizer_keys_on_the_command_line_edit_the_checkpoints_tokenizer(imported, caplog):
    """``data.tokenizer.KEY=`` alone edits the checkpoint's HFTokenizer (not the data group's default), a key it
    does not take is one line; the same file named again without eod_token keeps the recorded EOD, silently."""
    from mptrain.checkpoint.args import apply_checkpoint_args
    from mptrain.config.schema import as_config
    from mptrain.data.tokenizers import build_tokenizer
    from mptrain.errors import ConfigError

    hf_dir, ckpt, _ = imported["llama_untied"]
    saved = apply_checkpoint_args(as_config(compose([f"checkpoint.load={ckpt}"]))).data.tokenizer
    assert saved["eod_token"] == "</s>"
    vocab = [f"checkpoint.load={ckpt}", "data.tokenizer.vocab_size=500"]  # data=mock: NullTokenizer would replace it
    with pytest.raises(ConfigError) as err:
        apply_checkpoint_args(as_config(compose(vocab)), vocab)
    assert str(err.value) == (
        "data.tokenizer.vocab_size: the tokenizer comes from checkpoint.load (mptrain.data.tokenizers.HFTokenizer, "
        "checkpoint.use_checkpoint_args), which takes no 'vocab_size' (it accepts: eod_token, tokenizer_json); drop "
        "data.tokenizer.vocab_size (model.vocab_size sets the model's vocabulary), or replace the tokenizer: "
        "data.tokenizer._target_=... with its keys")
    eod = [f"checkpoint.load={ckpt}", "+data.tokenizer.eod_token=t5"]
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(eod)), eod)
    assert cfg.data.tokenizer == {**saved, "eod_token": "t5"} and build_tokenizer(cfg.data).eod == 5
    assert len(caplog.records) == 1 and cfg.checkpoint.hf_config["eos_token_id"] is None  # another EOD: warned
    caplog.clear()
    # the import's source file (same bytes as the checkpoint's copy), no eod_token: the recorded EOD, no warning
    same = [f"checkpoint.load={ckpt}", "data.tokenizer._target_=mptrain.data.tokenizers.HFTokenizer",
            "~data.tokenizer.vocab_size", f"+data.tokenizer.tokenizer_json={hf_dir / 'tokenizer.json'}"]
    with caplog.at_level("WARNING", logger="mptrain.checkpoint.args"):
        cfg = apply_checkpoint_args(as_config(compose(same)), same)
    assert cfg.data.tokenizer == {**saved, "tokenizer_json": str(hf_dir / "tokenizer.json")} and not caplog.records
    assert build_tokenizer(cfg.data).eod == EOS
    assert cfg.checkpoint.hf_config == {"model_type": "llama", "bos_token_id": 0, "eos_token_id": EOS}


def test_generate_refuses_a_tp_that_splits_no_query_group(imported, monkeypatch):
    """Generation checks heads and query groups against its tp before any process group exists."""
    from mptrain.errors import ConfigError
    from mptrain.generate import load_generator

    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        load_generator(str(imported["llama_untied"][1]), tensor_model_parallel_size=4)
    assert str(err.value) == ("--tensor-model-parallel-size=4: the checkpoint's model does not split over 4 ranks "
                              "(model.num_query_groups=2 is not divisible by parallel.tensor_model_parallel_size=4); "
                              "launch with a --nproc_per_node that divides it")


BOS_ID = VOCAB - 2  # "<s>" in the tokenizer of `_bos_tokenizer`


def _bos_tokenizer(path: Path, adds_bos: bool) -> None:
    """A word-level tokenizer ``t0 .. t97``, ``<s>``, ``</s>``. ``adds_bos``: Llama 3's way, a post-processor
    Sequence(ByteLevel, TemplateProcessing ``<s> $A``); else none (GPT-2's way: BOS named, never added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(BOS_ID)} | {"<s>": BOS_ID, "</s>": EOS},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": adds_bos}))


def _prompt_ids_task(rank: int, world: int, ckpt: str, prompt: str) -> list:
    from mptrain.generate import load_generator

    gen = load_generator(ckpt, prompt=prompt)
    try:
        return gen.prompt_ids
    finally:
        gen.groups.destroy()


@pytest.mark.parametrize("family", ["llama_untied", "gpt2"])
def test_prompt_and_documents_are_encoded_as_transformers_does(family, tmp_path):
    """The family's BOS rule holds on both sides: an imported Llama-style tokenizer (BOS in its post-processor)
    starts mptrain.generate's prompt with BOS, a GPT-2 one adds none; each equals transformers' ``tok(prompt)`` on
    the Hugging Face folder and on the export, and preprocessing writes ``[BOS] text [EOD]`` alike."""
    from mptrain.checkpoint.offline import atomic_meta, checkpoint_folder
    from mptrain.data.indexed import IndexedDataset
    from mptrain.data.preprocess import preprocess
    from mptrain.data.tokenizers import build_tokenizer

    hf_dir, ckpt, out, text = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out", "t5 t6 t7"
    FAMILIES[family]().save_pretrained(hf_dir)
    _bos_tokenizer(hf_dir, adds_bos=family != "gpt2")
    assert _cli("--import-hf", str(hf_dir), "--output", str(ckpt)) == 0
    assert _cli("--checkpoint", str(ckpt), "--output", str(out), "--format", "hf") == 0
    ours = run_distributed(_prompt_ids_task, 1, str(ckpt), text)[0]
    assert ours == ([BOS_ID, 5, 6, 7] if family != "gpt2" else [5, 6, 7])
    for folder in (hf_dir, out):
        assert transformers.AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] == ours, folder.name
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n")
    tokenizer = build_tokenizer(atomic_meta(checkpoint_folder(str(ckpt)))["config"]["data"])
    preprocess([str(corpus)], output_prefix=str(tmp_path / "d"), tokenizer=tokenizer, workers=1, progress=False)
    assert IndexedDataset(str(tmp_path / "d"))[0].tolist() == ours + [EOS]
