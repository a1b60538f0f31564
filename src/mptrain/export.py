"""Export a checkpoint as consolidated weights (safetensors + config json) or a Hugging Face folder
(GPT-2, Llama, Mistral, Qwen2), and import such a folder as a training starting point.

    python -m mptrain.export --checkpoint DIR [--iteration N] --output OUT [--format safetensors|hf|hf-gpt2]
        [--dtype float32|bfloat16|float16] [--hf-model-type gpt2|llama|mistral|qwen2] [--max-shard-size-mb MB]
    python -m mptrain.export --import-hf HF_DIR --output CKPT          (--import-hf-gpt2: GPT-2 only)

``--format hf`` / ``--import-hf`` (`export_hf`, `import_hf`): the family from ``config.json``, the
layouts in `mptrain.hf_models`; tensors are converted one at a time (import: one DCP file per tensor;
export: safetensors shards of at most ``--max-shard-size-mb``, ``model.safetensors.index.json``).

No torch.distributed is needed: the DCP checkpoint is read with ``no_dist=True``, each tensor
assembled at its full unpadded shape from whatever TP / PP / DP / ZeRO-1 layout wrote it.

``--format safetensors`` (default) writes ``model.safetensors`` ({tp1pp1 parameter name: full
unpadded tensor}, fp32 master weights when the run kept them) and ``config.json`` ({"format",
"iteration", "vocab_size", "model": the saved model config}); `load_consolidated` builds a tp1pp1
GPTModel from it in a plain process.

``--format hf-gpt2`` (architecture must match GPT-2: LayerNorm, gelu, learned absolute positions,
tied embeddings, biases, multi-head attention) writes ``model.safetensors`` with GPT-2 names,
``config.json`` for ``transformers.GPT2LMHeadModel`` and ``generation_config.json`` (pad = the
tokenizer's EOD; eos / bos = the imported model's, else the EOD: `special_ids`), and the tokenizer files (`mptrain.export_tokenizer`: the training
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

from mptrain.checkpoint import atomic, dcp_io, integrity
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
def checkpoint_folder(checkpoint: str, iteration: Optional[int] = None) -> Path:
    """The ``iter_N`` folder to read: ``checkpoint`` itself when it is a complete one, else the one
    ``checkpoint``'s ``latest`` (or ``iteration``) names; its files verified first (`verify_checkpoint`).

    The one folder resolution of the single-process readers (export, `mptrain.generate`).

    Raises:
        FileNotFoundError: no complete checkpoint there.
        ConfigError: a file does not match the folder's ``manifest.json`` (one line naming it).
    """
    folder = Path(checkpoint)
    if not atomic.is_complete(folder):
        folder, _ = atomic.resolve_load_dir(checkpoint, iteration)
        if folder is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint}; pass a checkpoint.save folder (with "
                                    "`latest`) or one iter_N folder")
    verify_checkpoint(folder)
    return folder


def verify_checkpoint(folder: Path) -> None:
    """Check every file of ``folder`` against its ``manifest.json`` on this process, as training's load
    does (`mptrain.checkpoint.integrity.verify_folder`); a folder saved before manifests existed passes.

    Raises:
        ConfigError: a file is corrupt, truncated or missing, or the manifest is unreadable (one line
            naming the file and the fix), before anything is read or written.
    """
    problem = integrity.verify_folder(folder, rank=0, world_size=1)
    if problem is not None:
        raise ConfigError(f"--checkpoint: {problem}; restore the file from an intact copy of the checkpoint, or "
                          "read another saved iteration (--iteration N)")


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
    folder = checkpoint_folder(checkpoint, iteration)
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
    """meta.json of ``folder``, its saved tokenizer file found beside the checkpoint when moved
    (`mptrain.checkpoint.api.atomic_meta` with ``required=True``). Raises OSError / ValueError when unreadable."""
    from mptrain.checkpoint.api import atomic_meta as read_meta

    return read_meta(folder, required=True)


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
def check_hf_expressible(model: dict, fmt: str) -> None:
    """Model keys the Hugging Face families written here cannot express, refused before anything is written.

    Raises:
        ConfigError: ``model.apply_layernorm_1p`` (weights stored as gamma - 1) or ``model.rotary_percent`` < 1
            (partial RoPE), one line naming the key and the format that keeps them.
    """
    if model.get("apply_layernorm_1p", False):
        raise ConfigError(f"export --format {fmt}: model.apply_layernorm_1p=true stores LayerNorm weights as gamma - 1, "
                          "which this export does not convert; use --format safetensors")
    if model.get("rotary_percent", 1.0) < 1.0:
        raise ConfigError(f"export --format {fmt}: model.rotary_percent={model['rotary_percent']} (partial RoPE) has no "
                          "spelling in the Hugging Face families written here; use --format safetensors")


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
                          + "; use --format hf (Llama / Mistral / Qwen2) or --format safetensors")


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
    """config.json of `transformers.GPT2Config` for our model dict; the weight dtype under ``dtype``, the key
    transformers >= 4.56 writes (older releases wrote ``torch_dtype``; the import reads either:
    `mptrain.hf_models.torch_dtype_of`)."""
    h = model["hidden_size"]
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
        "n_positions": model.get("max_position_embeddings") or model["seq_length"], "n_embd": h,
        "n_layer": model["num_layers"], "n_head": model["num_attention_heads"],
        "n_inner": model.get("ffn_hidden_size") or 4 * h, "activation_function": "gelu",
        "resid_pdrop": model.get("hidden_dropout", 0.0), "embd_pdrop": model.get("hidden_dropout", 0.0),
        "attn_pdrop": model.get("attention_dropout", 0.0), "layer_norm_epsilon": model.get("layernorm_epsilon", 1e-5),
        "initializer_range": model.get("init_method_std", 0.02), "scale_attn_weights": True,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None, "dtype": "float32",
    }


def _normal_modes(out: Path, names) -> None:
    """rw-r--r-- (less the umask) on the files written: safetensors writes through a 0600 temp file."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        os.chmod(out / name, 0o644 & ~umask)


def export_hf_gpt2(checkpoint: str, output: str, iteration: Optional[int] = None) -> tuple[Path, list]:
    """Write a folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load as is.

    Files: model.safetensors, config.json and generation_config.json (pad = EOD; bos / eos: `special_ids`)
    and the tokenizer (`mptrain.export_tokenizer`). Returns (the folder, notes for the user).
    """
    from safetensors.torch import save_file

    from mptrain.export_tokenizer import write_tokenizer_files

    state, meta = load_full_state(checkpoint, iteration)
    model = meta["config"]["model"]
    check_hf_expressible(model, "hf-gpt2")
    check_gpt2_compatible(model)
    hf = to_hf_gpt2({k: v.float() for k, v in state.items()}, model)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_gpt2_config(model, int(meta["vocab_size"]))
    eod, written, notes = write_tokenizer_files(meta["config"].get("data", {}), out,
                                                model_max_length=int(config["n_positions"]),
                                                special_ids=special_ids(meta, None))
    bos, eos = special_ids(meta, eod)
    config["bos_token_id"], config["eos_token_id"] = bos, eos
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eod, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    _normal_modes(out, ["model.safetensors", "config.json", "generation_config.json", *written])
    return out, notes


def hf_record(meta: dict) -> dict:
    """What a checkpoint knows of the Hugging Face config.json it came from: meta.json's ``hf`` (an import
    itself: model_type, dtype, bos / eos ids), else the saved ``checkpoint.hf_config`` (a run trained from
    an import carries it: model_type, bos / eos ids); {} for a model trained from scratch."""
    return meta.get("hf") or (meta.get("config", {}).get("checkpoint") or {}).get("hf_config") or {}


def special_ids(meta: dict, eod: Optional[int]) -> tuple:
    """(bos_token_id, eos_token_id) for config.json: the imported model's own (`hf_record`), else the
    tokenizer's EOD for both (GPT-2's convention: one <|endoftext|> separates documents, and training
    saw EOD between documents and nothing else)."""
    hf = hf_record(meta)
    bos, eos = hf.get("bos_token_id"), hf.get("eos_token_id")
    return (eod if bos is None else bos, eod if eos is None else eos)


def import_hf_gpt2(hf_dir: str, output: str) -> tuple[Path, list]:
    """`import_hf` for a GPT-2 folder (``--import-hf-gpt2``).

    Raises:
        ConfigError: the folder is not a GPT-2 (and `import_hf`'s errors).
    """
    from mptrain.hf_models import family_of

    path = Path(hf_dir) / "config.json"
    if path.is_file() and family_of(json.loads(path.read_text()), str(path)) != "gpt2":
        raise ConfigError(f"import-hf-gpt2: {path} is not a GPT-2; use --import-hf")
    return import_hf(hf_dir, output)


# --- Hugging Face families: Llama, Mistral, Qwen2, GPT-2 (streamed) --------------------------------
_IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")  # buffers, not weights
_DTYPE_NAMES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _safe_open(path: Path):
    """``safetensors.safe_open`` of one file, its failures one line.

    Raises:
        ConfigError: the file is missing, truncated or not safetensors.
    """
    from safetensors import safe_open

    if not path.is_file():
        raise ConfigError(f"import-hf: {path} is missing (model.safetensors.index.json lists it); copy the whole "
                          "Hugging Face folder")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors' own error type is not public API
        raise ConfigError(f"import-hf: {path} cannot be read as safetensors ({str(err).splitlines()[0]}); the file "
                          "is truncated or damaged: copy it again") from None


class HFTensors:
    """Tensors of a Hugging Face folder, read one at a time (``model.safetensors`` or the shards that
    ``model.safetensors.index.json`` lists).

    Raises:
        ConfigError: the folder holds neither file.
    """

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = {name: folder / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            with _safe_open(folder / "model.safetensors") as f:
                files = {name: folder / "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(f"import-hf: {folder} has no model.safetensors or model.safetensors.index.json "
                              "(save the model with safetensors)")
        self.files = files
        self._open = {}

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._open:
            self._open[path] = _safe_open(path)
        return self._open[path]

    def shape(self, name: str) -> tuple:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPE_NAMES.get(self._handle(name).get_slice(name).get_dtype(), torch.float32)

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def _gpt2_model(cfg: dict, notes: list) -> dict:
    """Our model dict for a GPT-2 config.json (``gelu_new`` imported as exact gelu, with a note)."""
    act = cfg.get("activation_function", "gelu_new")
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        notes.append(f"activation_function={act} (tanh approximation) imported as model.activation=gelu (exact erf)")
    elif act != "gelu":
        raise ConfigError(f"import-hf: activation_function={act!r} is not supported (gelu / gelu_new)")
    heads, h = int(cfg["n_head"]), int(cfg["n_embd"])
    return {"name": "gpt2", "num_layers": int(cfg["n_layer"]), "hidden_size": h, "num_attention_heads": heads,
            "ffn_hidden_size": cfg.get("n_inner") or 4 * h, "max_position_embeddings": int(cfg["n_positions"]),
            "seq_length": int(cfg["n_positions"]), "vocab_size": int(cfg["vocab_size"]),
            "layernorm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)), "normalization": "LayerNorm",
            "activation": "gelu", "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", True), "add_bias_linear": True}


def _gpt2_import_plan(names, model: dict) -> dict:
    """{our name: ([its GPT-2 name], fn)} for the GPT-2 tensors ``names`` (`from_hf_gpt2`, one tensor at a time)."""
    heads = model["num_attention_heads"]
    plan = {}
    for name in names:
        for ours in from_hf_gpt2({name: torch.empty(0)}, heads):  # the name mapping alone (an empty stand-in)
            plan[ours] = ([name], lambda ts, n=name, o=ours: from_hf_gpt2({n: ts[0]}, heads)[o])
    if model["untie_embeddings_and_output_weights"]:
        plan["output_layer.weight"] = (["lm_head.weight"], lambda ts: ts[0])
    return plan


def expected_shapes(model: dict) -> dict:
    """{our tp1pp1 name: global unpadded shape} of every parameter of ``model`` (a model dict).

    Built on the meta device (no memory, no init cost) by the trainer's own `build_model_chunks`.
    """
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks
    from mptrain.layers.sharding import collect_shard_specs

    chunk = build_model_chunks(model_config_from_dict(model), ParallelConfig(), _single_rank_groups(),
                               vocab_size=int(model["vocab_size"]), device=torch.device("meta"))[0]
    return {name: tuple(spec.global_shape) for name, spec in collect_shard_specs(chunk).items()}


def _meta_like(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zero-memory tensor of ``shape`` (DCP's plan reads only shape and dtype; the data comes later)."""
    return torch.empty((), dtype=dtype).expand(shape)


def _tokenizer_record(hf_path: Path, root: Path, cfg: dict) -> Optional[dict]:
    """``data.tokenizer`` for the imported checkpoint: the folder's tokenizer.json (copied next to the
    checkpoint, with the files that describe it: `mptrain.checkpoint.args.TOKENIZER_SIDECARS`, e.g.
    tokenizer_config.json, which the export writes back) with its EOS as EOD; None when there is none
    (the run's own data.tokenizer stays)."""
    import shutil

    from mptrain.checkpoint.args import TOKENIZER_SIDECARS

    src = hf_path / "tokenizer.json"
    if not src.is_file():
        return None
    from tokenizers import Tokenizer

    dst = root / "tokenizer.json"
    shutil.copyfile(src, dst)
    for name in TOKENIZER_SIDECARS:
        if (hf_path / name).is_file():
            shutil.copyfile(hf_path / name, root / name)
    tok = Tokenizer.from_file(str(dst))
    eos = None
    tok_cfg = hf_path / "tokenizer_config.json"
    if tok_cfg.is_file():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is None:
        eos_id = cfg.get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        eos = tok.id_to_token(int(eos_id)) if eos_id is not None else "<|endoftext|>"
    return {"_target_": "mptrain.data.tokenizers.HFTokenizer", "tokenizer_json": str(dst.resolve()), "eod_token": eos}


def check_new_output(path: Path, what: str) -> None:
    """``--output`` is a new or empty folder: export and import never mix their files with existing ones
    (a stale shard beside a new index, or an import taking over a run's ``latest``).

    Raises:
        ConfigError: ``path`` is a file or a folder that holds anything (one line).
    """
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ConfigError(f"{what}: --output {path} already exists and is not an empty folder; pick a new folder "
                          "(nothing there is overwritten)")


def import_hf(hf_dir: str, output: str) -> tuple[Path, list]:
    """Turn a Hugging Face Llama / Mistral / Qwen2 / GPT-2 folder into a checkpoint to train from.

    Writes ``output/iter_0000000`` + ``latest`` (iteration 0, no optimizer state) with each tensor in
    the source dtype, converted and written one at a time (never two copies of the model in memory),
    and ``output/tokenizer.json`` when the folder has one. Its saved config records the model
    (`mptrain.hf_models.model_from_hf_config`), ``data.tokenizer`` (`HFTokenizer` on that file, EOD =
    the model's EOS) and ``checkpoint.use_checkpoint_args=true``, so ``checkpoint.load=<output>``
    builds this model at any layout without the shape on the command line.

    Returns:
        (the checkpoint folder, notes for the user).
    Raises:
        ConfigError: no config.json, an unsupported family or feature, a tensor missing or of a shape
            config.json does not imply, or the checkpoint folder exists (each one line).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    from mptrain.checkpoint.api import FORMAT
    from mptrain.checkpoint.dcp_io import ChunkSavePlanner
    from mptrain.hf_models import family_of, llama_import_plan, model_from_hf_config

    hf_path = Path(hf_dir)
    if not (hf_path / "config.json").is_file():
        raise ConfigError(f"import-hf: {hf_path} has no config.json; pass a Hugging Face model folder "
                          "(config.json + model.safetensors)")
    cfg = json.loads((hf_path / "config.json").read_text())
    family = family_of(cfg, f"{hf_path / 'config.json'}")
    notes: list = []
    model = _gpt2_model(cfg, notes) if family == "gpt2" else model_from_hf_config(cfg)
    tensors = HFTensors(hf_path)
    names = sorted(n for n in tensors.files if not _IGNORED_HF.search(n))
    plan = _gpt2_import_plan([n for n in names if n != "lm_head.weight"], model) if family == "gpt2" \
        else llama_import_plan(model)
    want = expected_shapes(model)
    used = {src for sources, _ in plan.values() for src in sources}
    if not model["untie_embeddings_and_output_weights"]:
        used.add("lm_head.weight")  # a tied head saved anyway is the embedding
    missing = sorted({src for sources, _ in plan.values() for src in sources} - set(tensors.files))
    extra = sorted(set(names) - used)
    if missing or extra or set(plan) != set(want):
        raise ConfigError(f"import-hf: the weights do not match config.json: missing {missing[:4]}, not in the "
                          f"config {extra[:4]}" + (f", parameters {sorted(set(want) ^ set(plan))[:4]}"
                                                   if set(plan) != set(want) else ""))
    chunks, loaders, dtypes = [], {}, set()
    for ours, (sources, fn) in plan.items():
        shapes = ", ".join(f"{s} {list(tensors.shape(s))}" for s in sources)
        try:
            got = tuple(fn([torch.empty(tensors.shape(s), device="meta") for s in sources]).shape)
        except RuntimeError:  # the split / stacking of the fused layout does not fit these shapes
            got = None
        if got != want[ours]:
            gives = "no" if got is None else str(list(got))
            raise ConfigError(f"import-hf: {shapes} gives {gives} {ours}, config.json implies {list(want[ours])}; "
                              "the weights do not match config.json")
        dtype = tensors.dtype(sources[0])
        dtypes.add(dtype)
        chunks.append(Chunk(f"model/{ours}", want[ours], (0,) * len(want[ours]), _meta_like(want[ours], dtype)))
        loaders[f"model/{ours}"] = lambda sources=sources, fn=fn: fn([tensors.get(s) for s in sources]).contiguous()

    class StreamingPlanner(ChunkSavePlanner):
        def resolve_data(self, write_item):  # each tensor converted when DCP writes it, then dropped
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return loaders[write_item.index.fqn]()

    root = Path(output)
    folder = root / atomic.iter_dir_name(0)
    check_new_output(root, "import-hf")
    tmp = atomic.prepare_tmp(str(root), 0)
    tokenizer = _tokenizer_record(hf_path, root, cfg)
    param_dtype = "bfloat16" if dtypes == {torch.bfloat16} else "float16" if dtypes == {torch.float16} else "float32"
    layout = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": None}
    hf_config = {"model_type": family, "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
    # checkpoint.hf_config: training from this checkpoint saves it again (mptrain.checkpoint.args), for the export
    saved = {"model": model, "checkpoint": {"use_checkpoint_args": True, "hf_config": hf_config}}
    if tokenizer is not None:
        saved["data"] = {"tokenizer": tokenizer}
    common = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "scaler": None,
              "lr_scheduler": {"num_steps": 0}, "counters": {}, "layout": layout, "vocab_size": model["vocab_size"],
              "param_dtype": param_dtype, "config": saved, "torch_version": torch.__version__,
              "imported_from": str(hf_path)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # one file per tensor: DCP's writer keeps every tensor of a file alive until that file is written
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1)
        dcp.save({"common": common}, storage_writer=writer, planner=StreamingPlanner(chunks), no_dist=True)
    meta = {k: common[k] for k in ("format", "iteration", "consumed_samples", "layout", "vocab_size", "param_dtype",
                                   "torch_version", "config")}
    meta["hf"] = {**hf_config, "dtype": param_dtype}
    atomic.write_json(tmp / atomic.META_FILE, meta)
    integrity.write_manifest(tmp, [])  # as a training save: loading verifies the folder against it
    atomic.publish(str(root), 0, None)
    return folder, notes


def _load_one(folder: Path, metadata, key: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a DCP checkpoint at its full shape (no torch.distributed)."""
    shape = dcp_io.tensor_keys(metadata)[key][0]
    full = torch.empty(shape, dtype=dcp_io.tensor_dtype(metadata, key))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_io.load_chunks(str(folder), [Chunk(key, tuple(shape), (0,) * len(shape), full)], [], no_dist=True)
    return full.to(dtype)


def check_max_shard_size(max_shard_size_mb: float) -> None:
    """``--max-shard-size-mb`` is > 0 (MB per safetensors shard).

    Raises:
        ConfigError: 0, negative or NaN (one line), which would cut one shard per tensor (NaN: none).
    """
    if not max_shard_size_mb > 0:
        raise ConfigError(f"export --max-shard-size-mb={max_shard_size_mb:g}: must be > 0 (MB per safetensors "
                          "shard, default 5000); pass a positive size")


def export_hf(checkpoint: str, output: str, iteration: Optional[int] = None, *, dtype: Optional[str] = None,
              model_type: Optional[str] = None, max_shard_size_mb: float = 5000) -> tuple[Path, list]:
    """Write a Hugging Face folder (GPT-2, or Llama / Mistral / Qwen2) that ``AutoModelForCausalLM`` loads.

    The family: gpt2 for GPT-2's architecture (``model_type`` must be None or gpt2); for a Llama-architecture
    model ``model_type`` (llama / mistral / qwen2), else the one the checkpoint was imported from
    (`hf_record`, or the model's name, which training keeps), else from the architecture (qwen2 for a QKV
    bias alone, llama). bos / eos ids: `special_ids`. The dtype: ``dtype`` (float32 / bfloat16 / float16), else the checkpoint's parameter dtype
    (an imported checkpoint's: its source's). Tensors are read and converted one at a time and written
    in safetensors shards of at most ``max_shard_size_mb`` MB (``model.safetensors`` when one is
    enough, else ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``), so at most
    one shard is in memory. Also config.json, generation_config.json and the tokenizer files
    (`mptrain.export_tokenizer`).

    Returns:
        (the folder, notes for the user).
    Raises:
        ConfigError: the architecture has no Hugging Face family here, or ``model_type`` does not fit it
            (one line naming --hf-model-type); ``max_shard_size_mb`` is not > 0 (`check_max_shard_size`).
    """
    from safetensors.torch import save_file

    from mptrain.export_tokenizer import write_tokenizer_files
    from mptrain.hf_models import LLAMA_LIKE, hf_config_from_model, llama_export, llama_like_family

    check_max_shard_size(max_shard_size_mb)
    folder = checkpoint_folder(checkpoint, iteration)
    meta = atomic_meta(folder)
    model = meta["config"]["model"]
    check_hf_expressible(model, "hf")
    hf_meta = hf_record(meta)
    is_gpt2 = model.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    if is_gpt2:
        check_gpt2_compatible(model)
        family = "gpt2"
        if model_type not in (None, "gpt2"):  # GPT-2's architecture has no Llama-family spelling
            raise ConfigError(f"export --hf-model-type={model_type}: the model has GPT-2's architecture (learned "
                              "absolute positions, LayerNorm, gelu) and exports as gpt2; drop --hf-model-type or "
                              "pass --hf-model-type=gpt2")
    else:
        family = llama_like_family(model)
        # the import's family, kept through training by the model's name (`llama`, `mistral_7b`, `qwen2.5_7b`, ...)
        by_name = next((f for f in LLAMA_LIKE if str(model.get("name", "")).startswith(f)), None)
        wanted = model_type or hf_meta.get("model_type") or by_name
        if wanted in LLAMA_LIKE and (wanted == "qwen2") == (family == "qwen2"):
            family = wanted
        elif model_type is not None:
            raise ConfigError(f"export --hf-model-type={model_type}: the model exports as {family} "
                              f"({'a QKV bias' if family == 'qwen2' else 'no QKV-only bias'}); drop the option or pick "
                              f"{'qwen2' if family == 'qwen2' else 'llama or mistral'}")
    out_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype or hf_meta.get("dtype") or meta.get("param_dtype") or "float32"]
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    ours = sorted(k[len("model/"):] for k in tkeys if k.startswith("model/"))
    # the HF names and sizes first (shapes only), so shards are cut before any tensor is read
    layout = []
    for name in ours:
        empty = torch.empty(tkeys[f"model/{name}"][0], device="meta")
        if family == "gpt2":
            mapped = to_hf_gpt2({name: empty}, model)
        else:
            mapped = llama_export(name, empty, model)
        layout.append((name, {k: v.numel() * out_dtype.itemsize for k, v in mapped.items()}))
    shards, current, size = [], [], 0
    limit = max_shard_size_mb * 1_000_000
    for name, sizes in layout:
        if current and size + sum(sizes.values()) > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += sum(sizes.values())
    shards.append(current)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, names in zip(files, shards):
        tensors = {}
        for name in names:
            key = f"main/{name}" if f"main/{name}" in tkeys else f"model/{name}"  # fp32 master weights when kept
            t = _load_one(folder, metadata, key, out_dtype)
            mapped = to_hf_gpt2({name: t}, model) if family == "gpt2" else llama_export(name, t, model)
            tensors.update({k: v.contiguous() for k, v in mapped.items()})
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        del tensors
    written = list(files)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        written.append("model.safetensors.index.json")
    vocab_size = int(meta["vocab_size"])
    positions = int(model.get("max_position_embeddings") or model["seq_length"])
    eod, tok_files, notes = write_tokenizer_files(meta["config"].get("data", {}), out, model_max_length=positions,
                                                  special_ids=special_ids(meta, None))
    bos, eos = special_ids(meta, eod)
    if family == "gpt2":
        config = hf_gpt2_config(model, vocab_size)
        config.update(bos_token_id=bos, eos_token_id=eos, dtype=hf_dtype_name(out_dtype))
    else:
        config = hf_config_from_model(model, family, vocab_size=vocab_size, dtype=out_dtype, bos=bos, eos=eos)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eod, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    _normal_modes(out, [*written, "config.json", "generation_config.json", *tok_files])
    return out, notes


def hf_dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


# --- command line ---------------------------------------------------------------------------------
def check_import_args(args) -> None:
    """An import takes one Hugging Face folder and ``--output`` only.

    Raises:
        ConfigError: both ``--import-hf`` and ``--import-hf-gpt2``, or an export option (``--checkpoint``,
            ``--iteration``, ``--format``, ``--dtype``, ``--hf-model-type``) given with an import, which would
            otherwise be ignored (an import keeps the folder's dtype and family).
    """
    if args.import_hf and args.import_hf_gpt2:
        raise ConfigError("export: --import-hf and --import-hf-gpt2 each import one folder; pass one of them")
    given = [f"--{k.replace('_', '-')}" for k in ("checkpoint", "iteration", "format", "dtype", "hf_model_type")
             if getattr(args, k) is not None]
    if given:
        raise ConfigError(f"export --import-hf: {', '.join(given)} apply to exports only (an import keeps the "
                          "folder's dtype and family); drop them, then export the trained checkpoint with them")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="checkpoint.save folder (uses `latest`) or an iter_N folder")
    parser.add_argument("--iteration", type=int, default=None, help="which iteration (default: latest)")
    parser.add_argument("--output", required=True, help="the folder to write: the export (model.safetensors + config.json, or a Hugging "
                             "Face folder), or with --import-hf the checkpoint")
    parser.add_argument("--format", choices=("safetensors", "hf", "hf-gpt2"), default=None,
                        help="safetensors (default); hf: a Hugging Face folder of the model's family (GPT-2, Llama, "
                             "Mistral, Qwen2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="--format hf: weight dtype (default: the checkpoint's)")
    parser.add_argument("--hf-model-type", choices=("gpt2", "llama", "mistral", "qwen2"), default=None,
                        help="--format hf: the family of a Llama-architecture model (default: the imported one); "
                             "a GPT-2-architecture model exports as gpt2 only")
    parser.add_argument("--max-shard-size-mb", type=float, default=5000,
                        help="--format hf: safetensors shards of at most this size in MB (> 0; a tensor larger than "
                             "it gets a shard of its own; model.safetensors.index.json)")
    parser.add_argument("--import-hf", dest="import_hf", metavar="HF_DIR",
                        help="import a Hugging Face GPT-2 / Llama / Mistral / Qwen2 folder into a checkpoint at --output")
    parser.add_argument("--import-hf-gpt2", dest="import_hf_gpt2", metavar="HF_DIR", help="import a GPT-2 folder")
    args = parser.parse_args(argv)
    try:
        if args.import_hf or args.import_hf_gpt2:
            check_import_args(args)
            if args.import_hf:
                folder, notes = import_hf(args.import_hf, args.output)
            else:
                folder, notes = import_hf_gpt2(args.import_hf_gpt2, args.output)
            for w in notes:
                print(f"warning: {w}", file=sys.stderr)
            model = atomic_meta(folder)["config"]["model"]
            print(f"wrote {folder} ({model['name']}: {model['num_layers']} layers, hidden {model['hidden_size']}, "
                  f"vocab {model['vocab_size']}); train from it with checkpoint.load={args.output} "
                  "(the model and tokenizer come from the checkpoint)")
            return 0
        if not args.checkpoint:
            parser.error("--checkpoint is required (or --import-hf)")
        args.format = args.format or "safetensors"
        if args.hf_model_type is not None and args.format != "hf":
            raise ConfigError(f"export --hf-model-type={args.hf_model_type} applies to --format hf only (this is "
                              f"--format {args.format}); drop --hf-model-type or pass --format hf")
        check_max_shard_size(args.max_shard_size_mb)
        check_new_output(Path(args.output), "export")
        if args.format == "hf-gpt2":
            out, notes = export_hf_gpt2(args.checkpoint, args.output, args.iteration)
        elif args.format == "hf":
            out, notes = export_hf(args.checkpoint, args.output, args.iteration, dtype=args.dtype,
                                   model_type=args.hf_model_type, max_shard_size_mb=args.max_shard_size_mb)
        else:
            out, notes = export_consolidated(args.checkpoint, args.output, args.iteration), []
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {out} ({args.format})")
        return 0
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
