"""Export a checkpoint as consolidated weights (safetensors + config json) or a Hugging Face GPT-2
checkpoint, and import a GPT-2 checkpoint as a training starting point.

    python -m mptrain.export --checkpoint DIR [--iteration N] --output OUT [--format safetensors|hf-gpt2]
    python -m mptrain.export --import-hf-gpt2 HF_DIR --output CKPT

No torch.distributed is needed: the DCP checkpoint is read with ``no_dist=True``, each tensor
assembled at its full unpadded shape from whatever TP / PP / DP / ZeRO-1 layout wrote it.

``--format safetensors`` (default) writes ``model.safetensors`` ({tp1pp1 parameter name: full
unpadded tensor}, fp32 master weights when the run kept them) and ``config.json`` ({"format",
"iteration", "vocab_size", "model": the saved model config}); `load_consolidated` builds a tp1pp1
GPTModel from it in a plain process.

``--format hf-gpt2`` (architecture must match GPT-2: LayerNorm, gelu, learned absolute positions,
tied embeddings, biases, multi-head attention) writes ``model.safetensors`` with GPT-2 names,
``config.json`` for ``transformers.GPT2LMHeadModel`` and ``generation_config.json`` (eos / bos /
pad = the tokenizer's EOD), and the tokenizer files (`mptrain.export_tokenizer`: the training
``tokenizer.json`` for HFTokenizer, an exact byte-level equivalent for ByteTokenizer), so that
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` load it
with no edits. Files get mode 0644 (less the umask). Mapping (HF's Conv1D stores ``[in, out]``,
so every linear weight is transposed; our fused QKV rows are per head ``[q_i; k_i; v_i]``,
GPT-2's ``c_attn`` columns are ``[q_all; k_all; v_all]``):

    embedding.word_embeddings.weight              transformer.wte.weight            [V, h]
    embedding.position_embeddings.weight          transformer.wpe.weight            [n_positions, h]
    decoder.layers.i.input_layernorm.*            transformer.h.i.ln_1.*
    decoder.layers.i.self_attention.linear_qkv.*  transformer.h.i.attn.c_attn.*     ([3h, h] rows regrouped, ᵀ)
    decoder.layers.i.self_attention.linear_proj.* transformer.h.i.attn.c_proj.*     (ᵀ)
    decoder.layers.i.pre_mlp_layernorm.*          transformer.h.i.ln_2.*
    decoder.layers.i.mlp.linear_fc1.*             transformer.h.i.mlp.c_fc.*        (ᵀ)
    decoder.layers.i.mlp.linear_fc2.*             transformer.h.i.mlp.c_proj.*      (ᵀ)
    decoder.final_layernorm.*                     transformer.ln_f.*

``--import-hf-gpt2`` inverts that into a checkpoint folder (``iter_0000000`` + ``latest``) that
``checkpoint.load=CKPT`` starts from (iteration 0, fresh optimizer); HF's ``gelu_new`` (tanh
approximation, used by OpenAI's GPT-2) is imported with a warning, as our gelu is the exact erf form.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from mptrain.checkpoint import atomic, dcp_io
from mptrain.checkpoint.reshard import Chunk
from mptrain.errors import ConfigError

CONSOLIDATED_FORMAT = "mptrain-consolidated-1"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = {
    "input_layernorm": "ln_1", "self_attention.linear_qkv": "attn.c_attn", "self_attention.linear_proj": "attn.c_proj",
    "pre_mlp_layernorm": "ln_2", "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj",
}
_HF_TOP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
           "embedding.position_embeddings.weight": "transformer.wpe.weight",
           "decoder.final_layernorm.weight": "transformer.ln_f.weight",
           "decoder.final_layernorm.bias": "transformer.ln_f.bias"}


# --- reading a checkpoint without torch.distributed ------------------------------------------------
def load_full_state(checkpoint: str, iteration: Optional[int] = None, *, fp32_master: bool = True) -> tuple[dict, dict]:
    """All model weights of a checkpoint at full unpadded shape, in a single process.

    Args:
        checkpoint: the ``checkpoint.save`` folder (with ``latest``) or one ``iter_N`` folder.
        iteration: which iteration (default: ``latest``).
        fp32_master: prefer the fp32 main params (``main/<name>``) over half-precision weights.
    Returns:
        ({tp1pp1 parameter name: tensor}, meta.json contents).
    Raises:
        FileNotFoundError: no complete checkpoint there.
    """
    folder = Path(checkpoint)
    if not atomic.is_complete(folder):
        resolved, _ = atomic.resolve_load_dir(checkpoint, iteration)
        if resolved is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint}")
        folder = resolved
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    chunks, out = [], {}
    for key, (shape, _) in sorted(tkeys.items()):
        if not key.startswith("model/"):
            continue
        name = key[len("model/"):]
        src = f"main/{name}" if fp32_master and f"main/{name}" in tkeys else key
        full = torch.empty(shape, dtype=dcp_io.tensor_dtype(metadata, src))
        chunks.append(Chunk(src, tuple(shape), (0,) * len(shape), full))
        out[name] = full
    with warnings.catch_warnings():  # DCP notes that it runs without torch.distributed: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_io.load_chunks(str(folder), chunks, [], no_dist=True)
    return out, atomic_meta(folder)


def atomic_meta(folder: Path) -> dict:
    return json.loads((Path(folder) / atomic.META_FILE).read_text())


# --- consolidated safetensors ----------------------------------------------------------------------
def export_consolidated(checkpoint: str, output: str, iteration: Optional[int] = None) -> Path:
    """Write ``output/model.safetensors`` + ``output/config.json`` (see the module docstring)."""
    from safetensors.torch import save_file

    state, meta = load_full_state(checkpoint, iteration)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": CONSOLIDATED_FORMAT})
    config = {"format": CONSOLIDATED_FORMAT, "iteration": meta["iteration"], "vocab_size": meta["vocab_size"],
              "model": meta["config"]["model"]}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    _normal_modes(out, ["model.safetensors", "config.json"])
    return out


def _single_rank_groups():
    """ParallelGroups of a world of one, built without torch.distributed (no group handles)."""
    from mptrain.groups import GROUP_KINDS, ParallelGroups

    return ParallelGroups(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, vpp_size=None, tp_rank=0, dp_rank=0,
                          pp_rank=0, ranks={k: [0] for k in GROUP_KINDS}, handles={k: None for k in GROUP_KINDS})


def model_config_from_dict(model: dict):
    """A `ModelConfig` from a saved model-config dict (unknown keys ignored)."""
    from mptrain.config.model import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in model.items() if k in names})


def load_consolidated(path: str, *, dtype: torch.dtype = torch.float32):
    """A tp1pp1 `GPTModel` with the exported weights, built in a plain process (no torch.distributed).

    Padded vocab rows (``make_vocab_size_divisible_by``) are zero, as in training. Side effect:
    seeds torch's global RNG (model construction builds an RNG tracker).

    Raises:
        ValueError: the safetensors file lacks or has extra parameters, or a shape differs.
    """
    from safetensors.torch import load_file

    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks
    from mptrain.layers.sharding import collect_shard_specs, take_shard

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    model = build_model_chunks(model_config_from_dict(config["model"]), ParallelConfig(), _single_rank_groups(),
                               vocab_size=int(config["vocab_size"]), params_dtype=dtype)[0]
    specs = collect_shard_specs(model)
    names = dict(model.named_parameters())
    if set(names) != set(state):
        raise ValueError(f"{path}: parameters differ: missing {sorted(set(names) - set(state))}, "
                         f"extra {sorted(set(state) - set(names))}")
    with torch.no_grad():
        for name, param in names.items():
            spec = specs[name]
            if tuple(state[name].shape) != tuple(spec.global_shape):
                raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, model {spec.global_shape}")
            d = spec.partition_dim
            param.copy_(take_shard(state[name], spec, None if d is None else param.shape[d]))
    return model


# --- Hugging Face GPT-2 ---------------------------------------------------------------------------
def check_gpt2_compatible(model: dict) -> None:
    """Raises ConfigError naming every model key that GPT-2's architecture cannot express."""
    h, heads = model["hidden_size"], model["num_attention_heads"]
    problems = []
    for key, want in (("normalization", "LayerNorm"), ("activation", "gelu"),
                      ("position_embedding_type", "learned_absolute"), ("untie_embeddings_and_output_weights", False),
                      ("add_bias_linear", True)):
        if model.get(key, want) != want:
            problems.append(f"model.{key}={model.get(key)!r} (GPT-2: {want!r})")
    if model.get("num_query_groups") not in (None, heads):
        problems.append(f"model.num_query_groups={model['num_query_groups']} (GPT-2: multi-head, = {heads})")
    if model.get("kv_channels") not in (None, h // heads):
        problems.append(f"model.kv_channels={model['kv_channels']} (GPT-2: hidden_size / heads = {h // heads})")
    if problems:
        raise ConfigError("export --format hf-gpt2: the model is not a GPT-2: " + ", ".join(problems)
                          + "; use --format safetensors")


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rows [np × (q, k, v) × hn] → GPT-2's [(q, k, v) × np × hn] (weight [3h, h] or bias [3h])."""
    hn = t.shape[0] // (3 * heads)
    return t.reshape(heads, 3, hn, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    hn = t.shape[0] // (3 * heads)
    return t.reshape(3, heads, hn, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def to_hf_gpt2(state: dict, model: dict) -> dict:
    """{our name: tensor} → {GPT-2 name: tensor} (module docstring table)."""
    heads = model["num_attention_heads"]
    out = {}
    for name, t in state.items():
        if name in _HF_TOP:
            out[_HF_TOP[name]] = t
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            raise ConfigError(f"export --format hf-gpt2: no GPT-2 name for parameter {name}; use --format safetensors")
        layer, rest = m.groups()
        module, kind = rest.rsplit(".", 1)
        if module not in _HF_LAYER:
            raise ConfigError(f"export --format hf-gpt2: no GPT-2 name for parameter {name}")
        if module == "self_attention.linear_qkv":
            t = _qkv_to_hf(t, heads)
        if kind == "weight" and t.dim() == 2 and "layernorm" not in module:
            t = t.t()  # Conv1D: [in, out]
        out[f"transformer.h.{layer}.{_HF_LAYER[module]}.{kind}"] = t.contiguous()
    return out


def from_hf_gpt2(hf: dict, heads: int) -> dict:
    """Inverse of `to_hf_gpt2` (``lm_head.weight``, when tied, and HF's mask buffers are dropped)."""
    top = {v: k for k, v in _HF_TOP.items()}
    layer = {v: k for k, v in _HF_LAYER.items()}
    out = {}
    for name, t in hf.items():
        if not name.startswith(("transformer.", "lm_head")):
            name = "transformer." + name  # GPT2Model (no LM head) saves without the prefix
        if name in top:
            out[top[name]] = t
            continue
        m = re.match(r"^transformer\.h\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m is None or m.group(2) not in layer:
            continue  # lm_head (tied), attn.bias / masked_bias buffers
        i, module, kind = m.groups()
        ours = layer[module]
        if kind == "weight" and t.dim() == 2:
            t = t.t()
        if ours == "self_attention.linear_qkv":
            t = _qkv_from_hf(t, heads)
        out[f"decoder.layers.{i}.{ours}.{kind}"] = t.contiguous()
    return out


def hf_gpt2_config(model: dict, vocab_size: int) -> dict:
    """config.json of `transformers.GPT2Config` for our model dict."""
    h = model["hidden_size"]
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
        "n_positions": model.get("max_position_embeddings") or model["seq_length"], "n_embd": h,
        "n_layer": model["num_layers"], "n_head": model["num_attention_heads"],
        "n_inner": model.get("ffn_hidden_size") or 4 * h, "activation_function": "gelu",
        "resid_pdrop": model.get("hidden_dropout", 0.0), "embd_pdrop": model.get("hidden_dropout", 0.0),
        "attn_pdrop": model.get("attention_dropout", 0.0), "layer_norm_epsilon": model.get("layernorm_epsilon", 1e-5),
        "initializer_range": model.get("init_method_std", 0.02), "scale_attn_weights": True,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    }


def _normal_modes(out: Path, names) -> None:
    """rw-r--r-- (less the umask) on the files written: safetensors writes through a 0600 temp file."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        os.chmod(out / name, 0o644 & ~umask)


def export_hf_gpt2(checkpoint: str, output: str, iteration: Optional[int] = None) -> tuple[Path, list]:
    """Write a folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load as is.

    Files: model.safetensors, config.json and generation_config.json (eos = bos = pad = EOD) and the
    tokenizer (`mptrain.export_tokenizer`). Returns (the folder, notes for the user).
    """
    from safetensors.torch import save_file

    from mptrain.export_tokenizer import write_tokenizer_files

    state, meta = load_full_state(checkpoint, iteration)
    model = meta["config"]["model"]
    check_gpt2_compatible(model)
    hf = to_hf_gpt2({k: v.float() for k, v in state.items()}, model)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_gpt2_config(model, int(meta["vocab_size"]))
    eod, written, notes = write_tokenizer_files(meta["config"].get("data", {}), out,
                                                model_max_length=int(config["n_positions"]))
    config["bos_token_id"] = config["eos_token_id"] = eod
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    _normal_modes(out, ["model.safetensors", "config.json", "generation_config.json", *written])
    return out, notes


def import_hf_gpt2(hf_dir: str, output: str) -> tuple[Path, list]:
    """Turn a GPT-2 folder into a checkpoint (``iter_0000000`` + ``latest``) to start training from.

    Returns:
        (the checkpoint folder, warnings). Train from it with ``checkpoint.load=<output>`` and the
        model keys printed by the CLI (``model.num_layers=...``).
    Raises:
        ConfigError: the GPT-2 config cannot be expressed by our model (untied head with a
            different weight, unknown activation), or the checkpoint folder already exists.
    """
    from safetensors.torch import load_file

    from mptrain.checkpoint.api import FORMAT

    hf_path = Path(hf_dir)
    cfg = json.loads((hf_path / "config.json").read_text())
    notes = []
    act = cfg.get("activation_function", "gelu_new")
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        notes.append(f"activation_function={act} (tanh approximation) imported as model.activation=gelu (exact erf)")
    elif act != "gelu":
        raise ConfigError(f"import-hf-gpt2: activation_function={act!r} is not supported (gelu / gelu_new)")
    hf = load_file(str(hf_path / "model.safetensors"))
    heads, h = int(cfg["n_head"]), int(cfg["n_embd"])
    state = from_hf_gpt2(hf, heads)
    untied = not cfg.get("tie_word_embeddings", True)
    head = hf.get("lm_head.weight")
    if untied and head is not None:
        state["output_layer.weight"] = head
    model = {"num_layers": int(cfg["n_layer"]), "hidden_size": h, "num_attention_heads": heads,
             "ffn_hidden_size": cfg.get("n_inner") or 4 * h, "max_position_embeddings": int(cfg["n_positions"]),
             "vocab_size": int(cfg["vocab_size"]), "layernorm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
             "normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute",
             "untie_embeddings_and_output_weights": untied, "add_bias_linear": True}
    root = Path(output)
    folder = root / atomic.iter_dir_name(0)
    if folder.exists():
        raise ConfigError(f"import-hf-gpt2: {folder} exists; pick another --output")
    tmp = atomic.prepare_tmp(str(root), 0)
    chunks = [Chunk(f"model/{k}", tuple(v.shape), (0,) * v.dim(), v.float().contiguous()) for k, v in state.items()]
    layout = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": None}
    common = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "scaler": None,
              "lr_scheduler": {"num_steps": 0}, "counters": {}, "layout": layout, "vocab_size": model["vocab_size"],
              "param_dtype": "float32", "config": {"model": model}, "torch_version": torch.__version__,
              "imported_from": str(hf_path)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_io.save_chunks(str(tmp), chunks, {"common": common}, no_dist=True)
    meta = {k: common[k] for k in ("format", "iteration", "consumed_samples", "layout", "vocab_size", "param_dtype",
                                   "torch_version", "config")}
    atomic.write_json(tmp / atomic.META_FILE, meta)
    atomic.publish(str(root), 0, None)
    return folder, notes


# --- command line ---------------------------------------------------------------------------------
def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint.save folder (uses `latest`) or an iter_N folder")
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--output", required=True)
    parser.add_argument("--format", choices=("safetensors", "hf-gpt2"), default="safetensors")
    parser.add_argument("--import-hf-gpt2", dest="import_hf", metavar="HF_DIR",
                        help="import a GPT-2 folder into a checkpoint at --output instead")
    args = parser.parse_args(argv)
    try:
        if args.import_hf:
            folder, notes = import_hf_gpt2(args.import_hf, args.output)
            for w in notes:
                print(f"warning: {w}", file=sys.stderr)
            model = atomic_meta(folder)["config"]["model"]
            keys = " ".join(f"model.{k}={v}" for k, v in model.items() if k in ("num_layers", "hidden_size",
                            "num_attention_heads", "ffn_hidden_size", "max_position_embeddings", "vocab_size"))
            print(f"wrote {folder}; train from it with checkpoint.load={args.output} {keys}")
            return 0
        if not args.checkpoint:
            parser.error("--checkpoint is required (or --import-hf-gpt2)")
        if args.format == "hf-gpt2":
            out, notes = export_hf_gpt2(args.checkpoint, args.output, args.iteration)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
        else:
            out = export_consolidated(args.checkpoint, args.output, args.iteration)
        print(f"wrote {out} ({args.format})")
        return 0
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
