"""`pip install .` (not editable): the wheel carries conf/ and the corpus, and `python -m mptrain.plan`,
`python -m mptrain.check` and training (`mptrain-train`, the entry of `python -m mptrain.train`) with
data=shakespeare run from a folder outside the checkout, importing nothing from it."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from train_utils import read_rows, run_job, without_timing

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["data=shakespeare", "model=tiny", "train.train_iters=3", "train.eval_interval=null"]
PLAN = ["model=gpt_1.3b", "world_size=8", "format=json"]


def _untracked(tree: Path) -> list:
    """`git status`'s untracked paths of ``tree`` (a git work tree), each file listed."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tree, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return sorted(line[3:] for line in out.splitlines() if line.startswith("??"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(the built wheel, the --target folder it is installed into, the checkout's untracked paths after the
    build or None without git), built offline from a copy of the tree, itself a git work tree with the
    repository's .gitignore."""
    root = tmp_path_factory.mktemp("wheel")
    tree = root / "tree"
    shutil.copytree(REPO / "src", tree / "src", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(REPO / "conf", tree / "conf")
    (tree / "data").mkdir()
    shutil.copy(REPO / "data" / "shakespeare.jsonl.gz", tree / "data")
    for name in ("pyproject.toml", "README.md", ".gitignore"):
        shutil.copy(REPO / name, tree / name)
    git = shutil.which("git") is not None
    if git:  # every file of the copy staged: what the build adds shows as untracked unless .gitignore has it
        subprocess.run(["git", "init", "-q"], cwd=tree, check=True, timeout=60)
        subprocess.run(["git", "add", "-A"], cwd=tree, check=True, timeout=60)
        assert _untracked(tree) == []
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(tree)],
                   check=True, timeout=300, cwd=root)
    (built,) = (root / "dist").glob("mptrain-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(built)], check=True,
                   timeout=300, cwd=root)
    return built, root / "site", _untracked(tree) if git else None


def test_building_leaves_the_checkout_clean(wheel):
    """`pip install /path/to/mptrain` builds in the checkout (setuptools' build/, the egg-info): `git status` shows
    none of it."""
    *_, untracked = wheel
    if untracked is None:
        pytest.skip("git is not installed")
    assert untracked == []


def test_wheel_carries_the_config_tree_and_the_corpus(wheel):
    built, site, _ = wheel
    names = set(zipfile.ZipFile(built).namelist())
    conf = {f"mptrain/conf/{p.relative_to(REPO / 'conf')}" for p in (REPO / "conf").rglob("*.yaml")}
    assert conf and conf <= names
    assert (site / "mptrain" / "data" / "shakespeare.jsonl.gz").read_bytes() == (
        REPO / "data" / "shakespeare.jsonl.gz").read_bytes()
    assert not (site / "mptrain" / "conf").is_symlink()


def test_plan_check_and_training_run_from_the_installed_package(wheel, tmp_path):
    from mptrain.plan import plan_from_config
    from mptrain.planner.config import compose_plan

    _, site, _ = wheel
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    commands = {
        "where": [sys.executable, "-c", "import mptrain; print(mptrain.__file__)"],
        "plan": [sys.executable, "-m", "mptrain.plan", *PLAN],
        "check": [sys.executable, "-m", "mptrain.check", "model=tiny", "world_size=1"],
        "train": [str(site / "bin" / "mptrain-train"), *TRAIN, "run.dir=run"],
    }
    # concurrently: each is mostly start-up (importing torch)
    procs = {name: subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in commands.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, stderr[-3000:])
        out[name] = stdout
    assert Path(out["where"].strip()) == site / "mptrain" / "__init__.py"
    # the installed planner ranks the same layouts as the checkout's
    _, records = plan_from_config(compose_plan(PLAN))
    assert json.loads(out["plan"]) == json.loads(json.dumps(records))
    assert "worst measured-vs-planned deviation (weights, grads, main params): 0.000 % (tolerance 2 %)" in (
        out["check"].splitlines())
    # the shipped corpus, preprocessed into the user's cache (not into the installed package)
    assert list((tmp_path / "cache" / "mptrain").glob("shakespeare-*.idx"))
    assert not (site / "mptrain" / "data" / "cache").exists()
    # the installed trainer's rows equal the checkout's for the same job
    installed = read_rows(work / "run")
    assert [r["iteration"] for r in installed] == [1, 2, 3]
    run_job(0, 1, TRAIN + [f"run.dir={tmp_path / 'ref'}", f"data.cache_dir={tmp_path / 'cache' / 'mptrain'}"])
    assert without_timing(installed) == without_timing(read_rows(tmp_path / "ref"))
