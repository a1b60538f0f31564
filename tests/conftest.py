"""Suite-wide fixtures and the test tiers.

Tiers: a test that launches processes or runs a training job is marked ``integration`` at
collection (`pytest_collection_modifyitems`); the others are the unit tier (``make test-unit``:
``pytest -m "not integration"``). The rule reads the code of the test, of every fixture it uses and,
transitively, of the functions defined under tests/ that they name (helpers, tables of cases): a
reference to one of `LAUNCHERS` (the process pool of tests/harness.py, the forked interpreters of
tests/procs.py, a training job, mptrain's dry-run check, a benchmark job, `subprocess`,
`multiprocessing`) marks it, so a new test follows without a list; the marker's ``reason`` names
the chain. A launch the rule cannot see (a library function that starts processes on some inputs)
fails the test instead of running unseen (`_unit_tests_start_no_process`); such a test carries
``@pytest.mark.integration`` itself.

Default process group: `mptrain.training.run.run` keeps the world-1 default group it created
(`ParallelGroups.destroy` releases only the layout's sub-groups, so that the test pool and a sweep's
next job reuse it); a test that calls `run` in this process would otherwise hand it to every later
test (test_export asserts that the consolidated export needs none)."""

import gc
import inspect
import types
from pathlib import Path
from typing import Optional

import pytest

TESTS = Path(__file__).resolve().parent
# (module, attribute): what starts a process or a training job. A test naming one (calling it, importing it, passing
# it on), itself or through a fixture or a function defined under tests/, is an integration test.
LAUNCHERS = (
    ("harness", "run_distributed"),  # the persistent gloo process pool
    ("procs", "run_python"),  # `python ...` forked from the preloaded forkserver
    ("procs", "start_python"),
    ("procs", "forkserver"),
    ("train_utils", "run_job"),  # a training job (a pool task)
    ("mptrain.training.run", "run"),  # a training job in this process
    ("mptrain.training.run", "hydra_main"),
    ("mptrain.check", "run_check"),  # the dry run's spawned ranks
    ("run_bench", "run_process"),  # a benchmark job (bench/, on sys.path once tests/test_bench.py is imported)
    *(("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output", "getoutput",
                                        "getstatusoutput")),
    *(("multiprocessing", name) for name in ("Process", "Pool", "get_context")),
    *(("torch.multiprocessing", name) for name in ("spawn", "start_processes", "Process", "Pool", "get_context")),
)


def _function(obj):
    """The function behind ``obj``: a bound method (``multiprocessing.get_context`` is one) is a new object at
    every attribute read, its ``__func__`` is not."""
    return getattr(obj, "__func__", obj)


def _launcher_objects() -> dict:
    """{id(function): function} of the `LAUNCHERS` that import (a module no test imported cannot be named by one)."""
    import importlib

    out = {}
    for module, name in LAUNCHERS:
        try:
            obj = _function(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
        out[id(obj)] = obj  # kept alive here: its id cannot be reused by another object
    return out


def _code_objects(code: types.CodeType):
    """``code`` and the code nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _names(code: types.CodeType) -> tuple:
    """(global names read, attribute names read, modules imported) by ``code`` itself."""
    import dis

    globals_, attrs, imports = set(), set(), []
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globals_.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM"):
            attrs.add(ins.argval)
        elif ins.opname == "IMPORT_NAME":
            imports.append(ins.argval)
    return globals_, attrs, imports


class _LaunchFinder:
    """Which of `LAUNCHERS` a test's function reaches through the names its code uses (cached per function)."""

    def __init__(self) -> None:
        self.launchers = _launcher_objects()
        self.by_module = {}  # module name -> the launcher attributes it holds
        for module, name in LAUNCHERS:
            self.by_module.setdefault(module, set()).add(name)
        self.seen: dict = {}

    def path(self, fn) -> Optional[list]:
        """[fn, ..., the launcher] (qualified names) when ``fn`` reaches a launcher, else None. Followed: the
        functions defined under tests/ (tests, fixtures, helpers); a library's or mptrain's function is a launcher
        or not (`LAUNCHERS`), never read."""
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        if code is None or TESTS not in Path(code.co_filename).parents:
            return None
        key = id(code)
        if key not in self.seen:
            self.seen[key] = None  # recursion guard: a cycle adds nothing
            for c in _code_objects(code):
                found = self._code_path(c, fn.__globals__)
                if found is not None:
                    self.seen[key] = [f"{fn.__module__}.{fn.__qualname__}", *found]
                    break
        return self.seen[key]

    def _code_path(self, code: types.CodeType, namespace: dict) -> Optional[list]:
        import sys

        globals_, attrs, imports = _names(code)
        objs = [namespace.get(name) for name in globals_] + [sys.modules.get(name) or _helper(name) for name in imports]
        for obj in objs:
            if obj is None:
                continue
            if id(_function(obj)) in self.launchers:
                return [f"{_function(obj).__module__}.{_function(obj).__qualname__}"]
            if isinstance(obj, types.ModuleType):  # `subprocess.run`, `from harness import run_distributed`
                named = attrs & self.by_module.get(obj.__name__, set())
                if named:
                    return [f"{obj.__name__}.{min(named)}"]
                found = self._first_path([getattr(obj, a, None) for a in attrs])  # a helper module of tests/
            else:
                found = self._first_path([obj])
            if found is not None:
                return found
        return None

    def _first_path(self, objs: list) -> Optional[list]:
        for obj in objs:
            if inspect.isfunction(obj):
                candidates = [obj]
            elif inspect.isclass(obj):  # its methods (`path` reads those defined under tests/)
                candidates = [v for v in vars(obj).values() if inspect.isfunction(v)]
            elif isinstance(obj, (dict, list, tuple)):  # a table of cases (`CHILDREN = {name: fn}`): its functions
                candidates = [v for v in (obj.values() if isinstance(obj, dict) else obj) if inspect.isfunction(v)]
            else:
                continue
            for fn in candidates:
                found = self.path(fn)
                if found is not None:
                    return found
        return None


def _helper(name: str):
    """Module ``name`` imported here when it is a helper under tests/ not loaded yet (a test imports it inside its
    function); None for any other module not loaded (it holds no launcher: `_launcher_objects` loaded those)."""
    import importlib
    import importlib.util

    try:
        # the top-level name first: find_spec of ``a.b`` imports ``a`` (wandb, transformers: seconds at collection),
        # and a helper under tests/ is a top-level module
        top = importlib.util.find_spec(name.partition(".")[0])
        if top is None or not top.origin or TESTS not in Path(top.origin).parents:
            return None
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or TESTS not in Path(spec.origin).parents:
        return None
    return importlib.import_module(name)


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``integration`` every test whose function or fixtures reach a launcher (see the module docstring); the
    marker's ``reason`` names the chain, e.g. ``test_x.test_y -> harness.run_distributed``."""
    finder = _LaunchFinder()
    for item in items:
        if item.get_closest_marker("integration") is not None:
            continue
        fns = [getattr(item, "obj", None)]
        for defs in item._fixtureinfo.name2fixturedefs.values():
            fns += [d.func for d in defs]
        for fn in fns:
            found = finder.path(fn) if fn is not None else None
            if found is not None:
                item.add_marker(pytest.mark.integration(reason=" -> ".join(found)))
                break


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test of the unit tier cannot start a `multiprocessing` process (the harness's pool, the forkserver's
    children, a library's process pool): it fails with the fix instead of launching processes unseen."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    import multiprocessing.process

    def refuse(self):
        raise AssertionError(f"{request.node.nodeid} starts a process but is not an integration test: mark it "
                             "@pytest.mark.integration (the rule of tests/conftest.py did not see the launcher)")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(autouse=True)
def _long_lived_objects_leave_the_gc():
    """Suite time: what exists before a test (torch, Dynamo, Hydra, earlier tests' caches) is
    long-lived; `gc.freeze` keeps the cyclic GC from re-traversing it at each full collection. The
    collection first frees the previous test's cyclic garbage (frozen, it would never be freed);
    it traverses only what is not frozen yet, so it is short."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _release_the_default_process_group():
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
