"""Hugging Face checkpoints in and out: a registry of model families keyed by config.json's ``model_type``.

``families/``: one module per family, each listing its `Family` objects in ``FAMILIES`` (adding a family is adding
a module); ``mapping.py``: the two-way tensor mappings they are made of; ``io.py``: safetensors folders;
``tokenizer.py``: the tokenizer files; ``convert.py``: `import_hf` / `export_hf`, the one path of every family.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import Optional

from mptrain.errors import ConfigError
from mptrain.hf import families


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type``, as a ``families/`` module supplies it: ``model_type`` (the key), ``architecture``
    (config.json's ``architectures`` entry), ``title``, ``ignored`` (a regex matching buffers among tensor names),
    ``head`` (the output layer's name: a copy saved with tied embeddings is allowed), and the methods
    ``model_from_config(cfg, notes)`` (our model dict for config.json ``cfg``; a lossy step appends a line to ``notes``;
    ConfigError, one line, for what our model cannot express), ``config_from_model(model)`` (its config.json less
    vocab_size, bos / eos ids and dtype), ``problems(model)`` (what of our model it cannot express, ``model.KEY=value
    (Title: want)`` each), ``rules(model, names=())`` (the `mptrain.hf.mapping.Rule` of each parameter of ours; an MoE
    family's experts are more rules; ``names``: the tensors of the folder read, for a family that reads two layouts)
    and ``stored_name(name)`` (the rules' name of a tensor as a folder stores it).
    """

    model_type: str
    architecture: str
    title: str
    ignored, head = r"(?!)", "lm_head.weight"  # no buffers; Hugging Face's name of the output layer

    def stored_name(self, name: str) -> str:
        return name


@functools.cache
def registry() -> dict:
    """{model_type: Family} of the modules of ``mptrain/hf/families`` (name order, each in its ``FAMILIES`` order)."""
    modules = sorted(info.name for info in pkgutil.iter_modules(families.__path__))
    return {f.model_type: f for m in modules for f in importlib.import_module(f"{families.__name__}.{m}").FAMILIES}


def family_of(cfg: dict, where: str) -> Family:
    """The family of config.json ``cfg``: its ``model_type``, else its first known ``architectures`` entry; else a
    ConfigError (one line listing the registry)."""
    known = registry()
    by_arch = {f.architecture: f for f in known.values()}
    found = known.get(cfg.get("model_type")) or next((by_arch[a] for a in cfg.get("architectures") or ()
                                                      if a in by_arch), None)
    if found is None:
        raise ConfigError(f"import-hf: {where} has model_type={cfg.get('model_type')!r} (architectures "
                          f"{cfg.get('architectures')}), which is not supported; supported model_type: {', '.join(known)}")
    return found


def export_family(model: dict, *, model_type: Optional[str] = None, recorded: Optional[str] = None,
                  flag: str = "--format hf") -> Family:
    """The family our model dict exports as: ``model_type`` when given; else ``recorded`` (the imported one) or the
    one the model's name starts with (``mistral_7b``), if it expresses the model; else the first that does.
    ConfigError (one line naming ``flag``): ``model_type`` cannot express the model, or no family can."""
    known = registry()
    fits = [f for f in known.values() if not f.problems(model)]
    if model_type is not None and known[model_type] not in fits:
        family = known[model_type]
        fix = (f"it exports as {fits[0].model_type}: pass --format hf alone" if fits else
               f"use --format hf ({' / '.join(f.title for f in known.values() if f is not family)}) or --format safetensors")
        raise ConfigError(f"export {flag}: the model is not a {family.title}: {', '.join(family.problems(model))}; {fix}")
    if not fits:
        why = "; ".join(f"{f.title}: {', '.join(f.problems(model))}" for f in known.values())
        raise ConfigError(f"export {flag}: no Hugging Face family expresses the model ({why}); use --format safetensors")
    name = str(model.get("name", ""))
    wanted = [known.get(model_type), known.get(recorded), *(f for f in fits if name.startswith(f.model_type))]
    return next((f for f in wanted if f in fits), fits[0])
