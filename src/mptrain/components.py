"""The one place every component is built from its `_target_` (DESIGN.md §1 "Components").

A component is a config node with ``_target_`` (a dotted path to a class or function) and,
where the runtime supplies objects later (params, groups, the model), ``_partial_: true``. Each
component *kind* (optimizer, LR schedule, loss scaler, pipeline schedule, dataset provider,
tokenizer, logger, layer specs, ...) declares one `ComponentKind` beside its interface, in the
module that owns it; the trainer calls `check` for every kind at start-up (on every rank, before
any collective and before the run folder is written) and `build` where the object is made.

Keywords a target receives, in order of precedence:
1. ``runtime``: objects only the trainer has (``params``, ``groups``, ``optimizer``, ...), passed
   by the caller of `build`; never from the config.
2. the node's own keys (everything but ``_target_`` / ``_partial_`` / ``_convert_``): a user's
   ``+optim.alpha=0.95`` reaches ``torch.optim.RMSprop(alpha=0.95)``;
3. ``mapped``: keywords the kind derives from Megatron-named config keys (``optim.adam_beta1`` →
   ``betas``), passed only when the target's signature accepts them, so one ``optim`` node serves
   torch.optim.AdamW and RMSprop alike.

Errors (`ConfigError`, one line naming the config key, the dotted path and the fix):
- the target does not import;
- it lacks a method of the kind's interface;
- a node key is not a keyword of the target (the accepted keywords are listed);
- the target raises while being built (an optimizer rejecting ``lr=-1``): wrapped with its message.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import types
from typing import Any, Callable, Mapping, Optional, Sequence

from mptrain.errors import ConfigError

RESERVED_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


@dataclasses.dataclass(frozen=True)
class ComponentKind:
    """What the trainer requires of one kind of component.

    Attributes:
        name: what users call it in messages ("optimizer", "pipeline schedule").
        methods: callables an instance (or, for function targets, nothing) must expose, e.g.
            ``("step", "zero_grad", "state_dict", "load_state_dict")``; checked on the class before
            anything is built.
        runtime_keywords: keywords the trainer passes at build time (``("params",)``); they are
            not expected in the config and are exempt from the keyword check.
        interface: the Protocol / base class that documents the kind (for messages and docs).
    """

    name: str
    methods: tuple[str, ...] = ()
    runtime_keywords: tuple[str, ...] = ()
    interface: Optional[type] = None


def node_items(node: Any) -> dict:
    """A component node as a plain dict: a schema dataclass (its fields plus the extra keys a user
    added with ``+``), a DictConfig or a mapping; None stays empty."""
    if node is None:
        return {}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        out.update({k: v for k, v in vars(node).items() if k not in out})  # keys added with `+`
        return out
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(node)


def extra_keys(node: Any) -> dict:
    """The keys of a schema dataclass node that are not schema fields (a user target's own keywords)."""
    if not (dataclasses.is_dataclass(node) and not isinstance(node, type)):
        return {}
    fields = {f.name for f in dataclasses.fields(node)}
    return {k: v for k, v in vars(node).items() if k not in fields}


def import_target(key: str, target: Any) -> Callable:
    """The object a dotted path names (``pkg.module.Name`` or ``pkg.module.Outer.Name``).

    Raises:
        ConfigError: no ``_target_``, the path does not import, or it names a module or another value that
            cannot be called (naming ``key._target_``).
    """
    if callable(target) and not isinstance(target, str):
        return target
    if not target or not isinstance(target, str):
        raise ConfigError(f"{key}._target_ is missing; set it to a dotted path such as my_pkg.module.MyClass")
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name, attrs = ".".join(parts[:split]), parts[split:]
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise ConfigError(f"{key}._target_={target}: importing {module_name} failed ({type(err).__name__}: {err}); "
                              "install what it needs or fix the module") from None
        except Exception as err:  # noqa: BLE001 - a user module that raises at import
            raise ConfigError(f"{key}._target_={target}: importing {module_name} raised {type(err).__name__}: "
                              f"{_first_line(err)}; fix that module") from None
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"{key}._target_={target}: module {module_name} has no {'.'.join(attrs)}; "
                              "fix the dotted path (module.Name)") from None
        return _callable_target(key, target, obj)
    if len(parts) == 1 and target.isidentifier() and importlib.util.find_spec(target) is not None:
        _callable_target(key, target, importlib.import_module(target))  # "math": a module, not module.Name
    raise ConfigError(f"{key}._target_={target} does not import (no module {parts[0]!r}); fix the dotted path "
                      "(module.Name) or make the package importable (pip install -e, or PYTHONPATH)")


def _callable_target(key: str, target: str, obj: Any) -> Callable:
    """`obj` when it can be a ``_target_`` (a class or function); a module or any other value is one line."""
    if isinstance(obj, types.ModuleType):
        raise ConfigError(f"{key}._target_={target} is a module, not a class or function; name one in it "
                          f"({target}.Name)")
    if not callable(obj):
        raise ConfigError(f"{key}._target_={target} is not callable ({type(obj).__name__}); name a class or "
                          "function (module.Name)")
    return obj


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def accepted_keywords(fn: Callable) -> Optional[set[str]]:
    """The keyword names `fn` (a class: its ``__init__``) accepts; None when it takes ``**kwargs``
    or has no inspectable signature (then any keyword is passed through). A `torch.nn.Module` subclass
    without an ``__init__`` of its own accepts none: Module's ``**kwargs`` exist only to reject them."""
    cls = fn
    while isinstance(cls, functools.partial):  # a partial of the class (`build`): its keywords are config keys
        cls = cls.func
    init = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    if getattr(init, "__qualname__", None) == "Module.__init__" and init.__module__ == "torch.nn.modules.module":
        return set()
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names


def _check_methods(key: str, target: str, obj: Callable, kind: ComponentKind) -> None:
    if not kind.methods or not isinstance(obj, type):
        return
    missing = [m for m in kind.methods if not callable(getattr(obj, m, None))]
    if missing:
        where = f" ({kind.interface.__module__}.{kind.interface.__qualname__})" if kind.interface else ""
        raise ConfigError(f"{key}._target_={target} is not a valid {kind.name}: it lacks {', '.join(missing)}; "
                          f"the {kind.name} interface{where} needs {', '.join(kind.methods)}")


def resolve(key: str, node: Any, kind: ComponentKind, *, mapped: Optional[Mapping[str, Any]] = None,
            drop: Sequence[str] = (), schema_keys: Sequence[str] = ()) -> tuple[Callable, dict]:
    """Import ``node._target_``, check it against `kind`, and return (target, config keywords).

    Args:
        key: the config key of the node, for messages (``"optim"``, ``"model.transformer_layer"``).
        node: the component node (schema dataclass, DictConfig or mapping) holding ``_target_``.
        kind: the kind's requirements.
        mapped: keywords derived from Megatron-named keys; each is kept only if the target accepts it.
        drop: node keys that are not keywords of the target (schema fields consumed elsewhere,
            e.g. ``optim.lr_decay_style``).
        schema_keys: the node's schema fields, offered with the keywords as the fix of a misspelt key.
    Returns:
        (the imported target, the keywords to pass besides the runtime ones).
    Raises:
        ConfigError: see the module docstring.
    """
    items = node_items(node)
    target_path = items.get("_target_")
    target = import_target(key, target_path)
    _check_methods(key, str(target_path), target, kind)
    kwargs = {k: v for k, v in items.items() if k not in RESERVED_KEYS and k not in set(drop)}
    mapped_kw = dict(mapped or {})
    accepted = accepted_keywords(target)
    if accepted is not None:
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            offered = sorted(accepted - set(kind.runtime_keywords) - {"self"})
            close = difflib.get_close_matches(unknown[0], [*schema_keys, *offered], n=1)
            raise ConfigError(
                f"{key}.{unknown[0]}: {target_path} takes no keyword {unknown[0]!r}"
                + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else "")
                + f"; it accepts: {', '.join(offered) or '(none)'}; "
                + (f"did you mean {key}.{close[0]}? " if close else "")
                + f"remove the key (~{key}.{unknown[0]} where a preset sets it) or fix its name")
        mapped_kw = {k: v for k, v in mapped_kw.items() if k in accepted}
    return target, {**mapped_kw, **kwargs}


def build(key: str, node: Any, kind: ComponentKind, *, runtime: Optional[Mapping[str, Any]] = None,
          mapped: Optional[Mapping[str, Any]] = None, drop: Sequence[str] = (), partial: Optional[bool] = None) -> Any:
    """Build the component with `hydra.utils.instantiate` (``_convert_="all"``: plain lists and dicts).

    Args:
        runtime: the trainer's objects, passed as keywords (win over config keys of the same name).
        partial: True returns a ``functools.partial`` to call later (``_partial_: true`` in the node
            decides when None).
    Returns:
        the instance (or partial / function result).
    Raises:
        ConfigError: see `resolve`; and when the target raises TypeError / ValueError while being
            built (its message, the key and the fix).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target, kwargs = resolve(key, node, kind, mapped=mapped, drop=drop)
    items = node_items(node)
    is_partial = bool(items.get("_partial_", False)) if partial is None else partial
    spec = {"_target_": items.get("_target_"), "_convert_": "all", "_partial_": True, **kwargs}
    try:
        if not isinstance(spec["_target_"], str):
            # a callable given from Python (not from a config): its dotted path may not import, and its
            # keywords are Python objects already, so it is called as it is
            made = functools.partial(target, **kwargs, **dict(runtime or {}))
        else:
            # The runtime objects are bound outside instantiate: passed to it, they would be merged into
            # the node (a dict holding `_target_`, e.g. the resolved config, would be instantiated too).
            made = functools.partial(_instantiated(spec, target, instantiate), **dict(runtime or {}))
        return made if is_partial else made()
    except Exception as err:  # noqa: BLE001 - hydra wraps the target's own error in __cause__
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ is not None else err
        if isinstance(cause, (TypeError, ValueError)) and not isinstance(cause, ConfigError):
            passed = {k: v for k, v in kwargs.items() if k in (mapped or {})}  # the shared keys it takes
            raise rejected_arguments(key, items, cause, mapped=passed) from None
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


def _instantiated(spec: dict, target: Callable, instantiate: Callable) -> Any:
    """``instantiate(spec)`` of a partial spec (`build`): Hydra's partial of ``target`` with the node's keywords.

    One per distinct spec in a process when every keyword is a scalar (`_partial_of`): start-up time, a model
    builds the same spec nodes once per layer, and validation builds the components the run builds again
    (~1 ms of Hydra's work each). The partial is never changed (calls bind their runtime keywords around it),
    and Hydra re-checks its target policy at every call of it."""
    items = tuple((k, type(v), v) for k, v in spec.items() if k not in RESERVED_KEYS)
    if not all(v is None or isinstance(v, (str, int, float)) for _, _, v in items):  # bool is an int
        return instantiate(spec)
    allowlist = os.environ.get("HYDRA_INSTANTIATE_ALLOWLIST_OVERRIDE")  # the policy's one input besides the target
    return _partial_of(target, spec["_target_"], items, allowlist, instantiate)


@functools.lru_cache(maxsize=512)
def _partial_of(target: Callable, path: str, items: tuple, allowlist: Optional[str], instantiate: Callable) -> Any:
    """`_instantiated`'s memo, keyed by the imported ``target`` itself (a module attribute replaced since is
    another key), its dotted ``path``, the keywords with their types (1, 1.0 and True differ) and the allowlist."""
    return instantiate({"_target_": path, "_convert_": "all", "_partial_": True, **{k: v for k, _, v in items}})


def rejected_arguments(key: str, items: Mapping[str, Any], cause: BaseException, *,
                       mapped: Optional[Mapping[str, Any]] = None) -> ConfigError:
    """The one line for a target that raised TypeError / ValueError while being built: its message and the
    keys it was given (what the user can change): the node's own, and ``mapped`` (keywords filled from shared
    config keys, e.g. ``logger.project``); a ValueError where no key was given says the cause is the target's."""
    own = {k: v for k, v in items.items() if k not in RESERVED_KEYS and not isinstance(v, (dict, list))}
    shared = {k: v for k, v in (mapped or {}).items() if v is not None}
    given = ", ".join([f"{key}.{k}={v!r}" for k, v in own.items()]
                      + [f"{k}={v!r} (a shared key)" for k, v in shared.items()])
    nested = any(isinstance(v, (dict, list)) for k, v in items.items() if k not in RESERVED_KEYS)
    if not own and not shared and not nested and not isinstance(cause, TypeError):
        # a ValueError with no key of the user's given (a TypeError is a signature mismatch, e.g. a missing
        # required keyword: the keys are the fix): the cause is the target's own (its environment, its code)
        return ConfigError(f"{key}: {items.get('_target_')} failed while being built ({type(cause).__name__}: "
                           f"{_first_line(cause)}); no {key}.* keys were given to it, so the cause is in the "
                           "target or its environment")
    fix = f"fix the {key}.* keys" + (" or the shared keys it takes" if shared else "")
    return ConfigError(f"{key}: {items.get('_target_')} rejected its arguments ({type(cause).__name__}: "
                       f"{_first_line(cause)}); {fix}" + (f" (given: {given})" if given else ""))
