"""A Hugging Face folder into a checkpoint (`import_hf`) and back (`export_hf`), one tensor in memory at a time: one
path for every family of `mptrain.hf.registry` (its config.json mapping and tensor rules)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

from mptrain.checkpoint import offline
from mptrain.checkpoint.args import HF_CONFIG_KEYS
from mptrain.errors import ConfigError
from mptrain.hf import export_family, family_of, io
from mptrain.hf.tokenizer import checkpoint_tokenizer, import_tokenizer, write_tokenizer_files


def hf_record(meta: dict) -> dict:
    """The config.json values (model_type, bos / eos ids) of an import (meta.json's ``hf``) or of a run trained from one
    (its ``checkpoint.hf_config``); {} for a model trained from scratch."""
    return meta.get("hf") or (meta.get("config", {}).get("checkpoint") or {}).get("hf_config") or {}


def special_ids(meta: dict, eod: Optional[int], bos: Optional[int] = None) -> tuple:
    """(bos_token_id, eos_token_id) of config.json: the imported model's (`hf_record`), else the tokenizer's ``bos``
    (or EOD) and EOD (GPT-2's convention: training saw EOD between documents and nothing else)."""
    hf, first = hf_record(meta), eod if bos is None else bos
    return (first if hf.get("bos_token_id") is None else hf["bos_token_id"],
            eod if hf.get("eos_token_id") is None else hf["eos_token_id"])


def _import_tensors(family, model: dict, tensors: io.HFTensors) -> dict:
    """{our name: (shape, dtype, loader)}; ConfigError (one line): a tensor missing, extra or of another shape."""
    rules, want = {rule.ours: rule for rule in family.rules(model, tensors.names)}, offline.expected_shapes(model)
    needed = {src for rule in rules.values() for src in rule.hf}
    tied = set() if model["untie_embeddings_and_output_weights"] else {family.head}  # a saved tied head is allowed
    extra = sorted({n for n in tensors.names if not re.search(family.ignored, n)} - needed - tied)
    missing, odd = sorted(needed - set(tensors.names)), sorted(set(want) ^ set(rules))
    if missing or extra or odd:
        raise ConfigError(f"import-hf: the weights do not match config.json: missing {missing[:4]}, not in the config "
                          f"{extra[:4]}" + (f", parameters {odd[:4]}" if odd else ""))
    out = {}
    for ours, rule in rules.items():
        stand_ins = [tensors.meta(s) for s in rule.hf]
        try:  # the rule on the stand-ins: the shape it gives
            got = tuple(rule.from_hf(stand_ins).shape)
        except RuntimeError:  # the split / stacking of a fused layout does not fit these shapes
            got = None
        if got != want[ours]:
            shapes = ", ".join(f"{s} {list(t.shape)}" for s, t in zip(rule.hf, stand_ins))
            raise ConfigError(f"import-hf: {shapes} gives {'no' if got is None else list(got)} {ours}, config.json "
                              f"implies {list(want[ours])}; the weights do not match config.json")
        out[ours] = (want[ours], stand_ins[0].dtype, lambda r=rule: r.from_hf([tensors.get(s) for s in r.hf]))
    return out


def import_hf(hf_dir: str, output: str) -> tuple[Path, list]:
    """A Hugging Face folder as a checkpoint to train from (`offline.save_streamed`: iteration 0, each tensor in its
    source dtype), its tokenizer beside it; the saved config holds the model, ``data.tokenizer``, ``checkpoint.hf_config``
    (model_type, bos / eos ids) and ``use_checkpoint_args``: ``checkpoint.load=<output>`` makes the model at any layout.
    Returns (the checkpoint folder, notes). ConfigError (one line): no config.json, an unsupported family or feature,
    weights that do not match config.json, an ``output`` that is not new."""
    hf_path, root = Path(hf_dir), Path(output)
    if not (hf_path / "config.json").is_file():
        raise ConfigError(f"import-hf: {hf_path} has no config.json; pass a Hugging Face model folder "
                          "(config.json + model.safetensors)")
    cfg, notes = json.loads((hf_path / "config.json").read_text()), []
    family = family_of(cfg, str(hf_path / "config.json"))
    model = family.model_from_config(cfg, notes)
    tensors = _import_tensors(family, model, io.HFTensors(hf_path, family.stored_name))
    offline.check_new_output(root, "import-hf")
    root.mkdir(parents=True, exist_ok=True)
    hf_config = {key: cfg.get(key) for key in HF_CONFIG_KEYS} | {"model_type": family.model_type}
    # training from this checkpoint saves checkpoint.hf_config again (mptrain.checkpoint.args), for the export
    config = {"model": model, "checkpoint": {"use_checkpoint_args": True, "hf_config": hf_config}}
    tokenizer = import_tokenizer(hf_path, root, cfg)
    config.update({"data": {"tokenizer": tokenizer}} if tokenizer else {})
    return offline.save_streamed(root, tensors, config=config, extra={"hf": hf_config, "imported_from": str(hf_path)}), notes


def export_hf(checkpoint: str, output: str, iteration: Optional[int] = None, *, dtype: Optional[str] = None,
              model_type: Optional[str] = None, max_shard_size_mb: float = 5000,
              flag: str = "--format hf") -> tuple[Path, list]:
    """A Hugging Face folder that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load as is: the family `export_family`
    picks, in ``dtype`` (default: the checkpoint's), shards of at most ``max_shard_size_mb`` MB, config.json,
    generation_config.json (bos / eos: `special_ids`; pad: the EOD), the tokenizer files. Returns (the folder, notes).
    ConfigError (one line naming ``flag``): no family expresses the model, or ``model_type`` does not."""
    folder = offline.checkpoint_folder(checkpoint, iteration)
    meta = offline.atomic_meta(folder)
    model, data = meta["config"]["model"], meta["config"].get("data", {})
    family = export_family(model, model_type=model_type, recorded=hf_record(meta).get("model_type"), flag=flag)
    dtype = dtype or meta.get("param_dtype") or "float32"
    rules, entries = {rule.ours: rule for rule in family.rules(model)}, offline.model_tensors(folder)
    unknown = sorted(set(entries) - set(rules))
    if unknown:
        raise ConfigError(f"export {flag}: no {family.title} name for parameters {unknown[:4]}; use --format safetensors")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)

    def load(name: str) -> dict:  # {HF name: tensor} of our parameter ``name``, read now
        tensor = offline.load_tensor(folder, entries[name]).to(io.DTYPES[dtype])
        return dict(zip(rules[name].hf, rules[name].to_hf(tensor)))

    sizes = [(name, io.DTYPES[dtype].itemsize * math.prod(shape)) for name, (_, shape, _) in entries.items()]
    written = io.write_shards(out, sizes, load, max_shard_size_mb)
    tokenizer, notes = checkpoint_tokenizer(data)
    eod = None if tokenizer is None else tokenizer.eod
    bos, eos = special_ids(meta, eod, getattr(tokenizer, "bos", None))
    if tokenizer is not None:
        _, files, more = write_tokenizer_files(data, out, special_ids=(bos, eos), tokenizer=tokenizer,
                                               model_max_length=model.get("max_position_embeddings") or model["seq_length"])
        written, notes = written + files, notes + more
    ids = {"bos_token_id": bos, "eos_token_id": eos}
    (out / "config.json").write_text(json.dumps({**family.config_from_model(model), "vocab_size": int(meta["vocab_size"]),
                                                 **ids, "dtype": dtype}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({**ids, "pad_token_id": eod, "do_sample": False}, indent=1))
    offline.normal_modes(out, [*written, "config.json", "generation_config.json"])
    return out, notes
