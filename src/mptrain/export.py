"""Export a checkpoint as consolidated weights or a Hugging Face folder; import a Hugging Face folder or a Megatron-LM
checkpoint.

    python -m mptrain.export --checkpoint DIR [--iteration N] --output OUT [--format safetensors|hf] [--dtype D]
        [--hf-model-type TYPE] [--max-shard-size-mb MB]      (safetensors: mptrain.checkpoint.offline.export_consolidated)
    python -m mptrain.export --import-hf HF_DIR --output CKPT     (--format hf and --import-hf: mptrain.hf.convert)
    python -m mptrain.export --import-megatron DIR [--iteration N] --output CKPT    (mptrain.megatron_ckpt.convert)

The old spellings ``--format hf-gpt2`` and ``--import-hf-gpt2`` still work, printing the new one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from mptrain.checkpoint import offline
from mptrain.errors import ConfigError
from mptrain.hf import registry
from mptrain.hf.io import DTYPES

LEGACY_FORMATS = {"hf-gpt2": ("gpt2", "float32")}  # old --format: --format hf's --hf-model-type and --dtype
IMPORTS = ("import_hf", "import_hf_gpt2", "import_megatron")  # the sources of an import (one at a time)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mptrain.export", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--checkpoint", help="checkpoint.save folder (uses `latest`) or an iter_N folder")
    add("--iteration", type=int, default=None, help="which iteration (default: latest; --import-megatron: its iter_N)")
    add("--output", required=True, help="the folder to write (new or empty): the export, or the imported checkpoint")
    add("--format", choices=("safetensors", "hf", *LEGACY_FORMATS), default=None,
        help="safetensors (default: model.safetensors + config.json); hf: a Hugging Face folder "
        "(hf-gpt2: its old spelling)")
    add("--dtype", choices=tuple(DTYPES), default=None, help="--format hf: weight dtype (default: the checkpoint's)")
    add("--hf-model-type", choices=tuple(registry()), default=None,
        help="--format hf: the family (default: the imported one, else the first that expresses the model)")
    add("--max-shard-size-mb", type=float, default=5000,
        help="--format hf: safetensors shards of at most this size in MB (> 0; a larger tensor gets its own)")
    add("--import-hf", metavar="HF_DIR", help="import a Hugging Face folder into a checkpoint at --output")
    add("--import-hf-gpt2", metavar="HF_DIR", help="the old spelling of --import-hf")
    add("--import-megatron", metavar="DIR", help="import a Megatron-LM checkpoint (torch_dist or legacy torch; its "
        "--save folder or one iter_N folder) into a checkpoint at --output")
    return parser


def _import(args) -> None:
    """Raises ConfigError: two sources, or an export option (an import keeps the source's dtype and model)."""
    from mptrain.hf.convert import import_hf
    from mptrain.megatron_ckpt.convert import import_megatron

    sources = [f"--{k.replace('_', '-')}" for k in IMPORTS if getattr(args, k)]
    if len(sources) > 1:
        raise ConfigError(f"export: {' and '.join(sources)} each import one folder; pass one of them")
    megatron = bool(args.import_megatron)
    given = [f"--{k.replace('_', '-')}" for k in ("checkpoint", "iteration", "format", "dtype", "hf_model_type")
             if getattr(args, k) is not None and not (megatron and k == "iteration")]
    if given:
        raise ConfigError(f"export {sources[0]}: {', '.join(given)} apply to exports only (an import keeps the "
                          "source's dtype and model); drop them, then export the trained checkpoint with them")
    if args.import_hf_gpt2:
        print("note: --import-hf-gpt2 is spelled --import-hf now (the old spelling goes away)")
    folder, notes = (import_megatron(args.import_megatron, args.output, args.iteration) if megatron
                     else import_hf(args.import_hf or args.import_hf_gpt2, args.output))
    for note in notes:
        print(f"{'note' if megatron else 'warning'}: {note}", file=sys.stderr)
    model = offline.atomic_meta(folder)["config"]["model"]
    print(f"wrote {folder} ({model['name']}: {model['num_layers']} layers, hidden {model['hidden_size']}, vocab "
          f"{model['vocab_size']}); train from it with checkpoint.load={args.output} (the model, and the tokenizer "
          "where one was carried, come from the checkpoint)")


def _export(args) -> None:
    """Raises ConfigError: ``--hf-model-type`` without ``--format hf``, a size not > 0 (or NaN), an ``--output`` in use."""
    from mptrain.hf.convert import export_hf

    fmt, model_type, dtype = args.format or "safetensors", args.hf_model_type, args.dtype
    if model_type is not None and fmt != "hf":
        raise ConfigError(f"export --hf-model-type={model_type} applies to --format hf only (this is --format {fmt}); "
                          "drop --hf-model-type or pass --format hf")
    if not args.max_shard_size_mb > 0:
        raise ConfigError(f"export --max-shard-size-mb={args.max_shard_size_mb:g}: must be > 0 (MB per safetensors "
                          "shard, default 5000); pass a positive size")
    offline.check_new_output(Path(args.output), "export")
    flag = f"--hf-model-type={model_type}" if model_type else "--format hf"
    if fmt in LEGACY_FORMATS:
        (model_type, legacy_dtype), flag = LEGACY_FORMATS[fmt], f"--format {fmt}"
        dtype = dtype or legacy_dtype
        print(f"note: --format {fmt} is spelled --format hf --hf-model-type {model_type} --dtype {dtype} now (the old "
              "spelling goes away)")
    out, notes = (offline.export_consolidated(args.checkpoint, args.output, args.iteration), []) if fmt == "safetensors" \
        else export_hf(args.checkpoint, args.output, args.iteration, dtype=dtype, model_type=model_type,
                       max_shard_size_mb=args.max_shard_size_mb, flag=flag)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out} ({'hf' if fmt in LEGACY_FORMATS else fmt})")


def main(argv: Optional[list] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    importing = any(getattr(args, k) for k in IMPORTS)
    if not (args.checkpoint or importing):
        parser.error("--checkpoint is required (or --import-hf / --import-megatron)")
    try:
        (_import if importing else _export)(args)
        return 0
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
