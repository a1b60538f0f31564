"""A Hugging Face folder into a checkpoint (`import_hf`) and a checkpoint into one (`export_hf`), for every family
of the registry (`mptrain.hf.registry`) the same way: the family's config.json mapping and tensor rules, one
tensor converted at a time (never two copies of the model in memory), the tokenizer files.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

from mptrain.checkpoint import offline
from mptrain.errors import ConfigError
from mptrain.hf import export_family, family_of, io
from mptrain.hf.tokenizer import checkpoint_tokenizer, import_tokenizer, write_tokenizer_files


def hf_record(meta: dict) -> dict:
    """The Hugging Face config.json values a checkpoint came with (model_type, bos / eos ids): meta.json's ``hf`` (an
    import), else the saved ``checkpoint.hf_config`` (a run trained from one); {} for a model trained from scratch."""
    return meta.get("hf") or (meta.get("config", {}).get("checkpoint") or {}).get("hf_config") or {}


def special_ids(meta: dict, eod: Optional[int], bos: Optional[int] = None) -> tuple:
    """(bos_token_id, eos_token_id) of config.json: the imported model's own (`hf_record`), else the tokenizer's ``bos``
    (or EOD) and EOD (GPT-2's convention: training saw EOD between documents and nothing else)."""
    hf = hf_record(meta)
    first = eod if bos is None else bos
    return (first if hf.get("bos_token_id") is None else hf["bos_token_id"],
            eod if hf.get("eos_token_id") is None else hf["eos_token_id"])


def _import_tensors(family, model: dict, tensors: io.HFTensors) -> dict:
    """{our name: (shape, dtype, loader)} for `offline.save_streamed`, each shape checked on the meta device.

    Raises:
        ConfigError: a tensor missing or extra, or of a shape config.json does not imply (one line).
    """
    rules = {rule.ours: rule for rule in family.rules(model)}
    want = offline.expected_shapes(model)
    names = {n for n in tensors.names if not re.search(family.ignored, n)}
    needed = {src for rule in rules.values() for src in rule.hf}
    extra = sorted(names - needed - ({family.head} if not model["untie_embeddings_and_output_weights"] else set()))
    missing = sorted(needed - names)
    if missing or extra or set(rules) != set(want):
        raise ConfigError(f"import-hf: the weights do not match config.json: missing {missing[:4]}, not in the "
                          f"config {extra[:4]}" + (f", parameters {sorted(set(want) ^ set(rules))[:4]}"
                                                   if set(rules) != set(want) else ""))
    out = {}
    for ours, rule in rules.items():
        try:  # the family's mapping on zero-memory stand-ins: the shape it gives
            got = tuple(rule.from_hf([torch.empty(tensors.shape(s), device="meta") for s in rule.hf]).shape)
        except RuntimeError:  # the split / stacking of a fused layout does not fit these shapes
            got = None
        if got != want[ours]:
            shapes = ", ".join(f"{s} {list(tensors.shape(s))}" for s in rule.hf)
            raise ConfigError(f"import-hf: {shapes} gives {'no' if got is None else list(got)} {ours}, config.json "
                              f"implies {list(want[ours])}; the weights do not match config.json")
        out[ours] = (want[ours], tensors.dtype(rule.hf[0]), lambda r=rule: r.from_hf([tensors.get(s) for s in r.hf]))
    return out


def import_hf(hf_dir: str, output: str) -> tuple[Path, list]:
    """A Hugging Face folder as a checkpoint to train from: ``output/iter_0000000`` + ``latest``
    (`mptrain.checkpoint.offline.save_streamed`, each tensor in its source dtype) and the tokenizer beside it. The
    saved config holds the model, ``data.tokenizer``, ``checkpoint.use_checkpoint_args=true`` and
    ``checkpoint.hf_config`` (model_type, bos / eos ids: the export's), so ``checkpoint.load=<output>`` makes this
    model at any layout. Returns (the checkpoint folder, notes for the user).

    Raises:
        ConfigError: no config.json, an unsupported family or feature, a tensor missing or of a shape config.json
            does not imply, or ``output`` is not a new folder (each one line).
    """
    from mptrain.checkpoint.args import HF_CONFIG_KEYS

    hf_path, root = Path(hf_dir), Path(output)
    if not (hf_path / "config.json").is_file():
        raise ConfigError(f"import-hf: {hf_path} has no config.json; pass a Hugging Face model folder "
                          "(config.json + model.safetensors)")
    cfg = json.loads((hf_path / "config.json").read_text())
    family, notes = family_of(cfg, str(hf_path / "config.json")), []
    model = family.model_from_config(cfg, notes)
    tensors = _import_tensors(family, model, io.HFTensors(hf_path, family.stored_name))
    offline.check_new_output(root, "import-hf")
    root.mkdir(parents=True, exist_ok=True)
    hf_config = {key: cfg.get(key) for key in HF_CONFIG_KEYS} | {"model_type": family.model_type}
    # checkpoint.hf_config: training from this checkpoint saves it again (mptrain.checkpoint.args), for the export
    config = {"model": model, "checkpoint": {"use_checkpoint_args": True, "hf_config": hf_config}}
    tokenizer = import_tokenizer(hf_path, root, cfg)
    if tokenizer is not None:
        config["data"] = {"tokenizer": tokenizer}
    extra = {"hf": hf_config, "imported_from": str(hf_path)}
    return offline.save_streamed(root, tensors, config=config, extra=extra), notes


def export_hf(checkpoint: str, output: str, iteration: Optional[int] = None, *, dtype: Optional[str] = None,
              model_type: Optional[str] = None, max_shard_size_mb: float = 5000,
              flag: str = "--format hf") -> tuple[Path, list]:
    """A Hugging Face folder that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load as is: of the family
    `mptrain.hf.export_family` picks, in ``dtype`` (default: the checkpoint's), each tensor read and converted
    alone, in shards of at most ``max_shard_size_mb`` MB; config.json, generation_config.json (bos / eos:
    `special_ids`; pad: the EOD) and the tokenizer files. Returns (the folder, notes for the user).

    Raises:
        ConfigError: no family expresses the model, or ``model_type`` does not (one line naming ``flag``).
    """
    folder = offline.checkpoint_folder(checkpoint, iteration)
    meta = offline.atomic_meta(folder)
    model, vocab_size = meta["config"]["model"], int(meta["vocab_size"])
    family = export_family(model, model_type=model_type, recorded=hf_record(meta).get("model_type"), flag=flag)
    dtype = dtype or meta.get("param_dtype") or "float32"
    rules = {rule.ours: rule for rule in family.rules(model)}
    entries = offline.model_tensors(folder)
    unknown = sorted(set(entries) - set(rules))
    if unknown:
        raise ConfigError(f"export {flag}: no {family.title} name for parameters {unknown[:4]}; use --format safetensors")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)

    def load(name: str) -> dict:  # {HF name: tensor} of our parameter ``name``, read now
        return dict(zip(rules[name].hf, rules[name].to_hf(offline.load_tensor(folder, entries[name]).to(io.DTYPES[dtype]))))

    sizes = [(name, io.DTYPES[dtype].itemsize * math.prod(shape)) for name, (_, shape, _) in entries.items()]
    written = io.write_shards(out, sizes, load, max_shard_size_mb)
    tokenizer, notes = checkpoint_tokenizer(meta["config"].get("data", {}))
    eod = None if tokenizer is None else tokenizer.eod
    bos, eos = special_ids(meta, eod, getattr(tokenizer, "bos", None))
    if tokenizer is not None:
        _, tok_files, more = write_tokenizer_files(meta["config"].get("data", {}), out, special_ids=(bos, eos),
                                                   model_max_length=model.get("max_position_embeddings") or
                                                   model["seq_length"], tokenizer=tokenizer)
        written, notes = written + tok_files, notes + more
    config = {**family.config_from_model(model), "vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos,
              "dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eod, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    offline.normal_modes(out, [*written, "config.json", "generation_config.json"])
    return out, notes
