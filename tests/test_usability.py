"""User mistakes found by trying the trainer as a new user: each is one clear error, early."""

import json

import numpy as np
import pytest

from harness import run_distributed
from mptrain.data.indexed import IndexedDatasetWriter
from mptrain.errors import ConfigError
from train_utils import compose, read_rows, run_job


def _write_prefix(tmp_path, max_id: int) -> str:
    prefix = str(tmp_path / "corpus")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        writer.add_document(rng.integers(0, max_id + 1, size=200).astype(np.uint16))
    writer.finalize()
    return prefix


def test_data_from_another_tokenizer_is_one_error(tmp_path):
    """Ids ≥ the tokenizer's vocabulary (data preprocessed with another tokenizer) fail before training."""
    prefix = _write_prefix(tmp_path, max_id=300)  # the byte tokenizer has 257 ids
    from mptrain.training.run import run

    with pytest.raises(ConfigError, match=r"holds token id 300 but data.tokenizer has 257 ids"):
        run(compose(["data=indexed", f"data.prefixes=[{prefix}]", "data.split='80,10,10'", f"run.dir={tmp_path}/r"]))


def test_a_missing_data_prefix_leaves_no_run_folder_and_no_move_line(tmp_path, monkeypatch, capsys):
    """The run folder is claimed once the run has built (data included): a prefix that does not exist is the only
    line; the default folder's `-2` is not created nor announced, a run.dir= from the command line not created."""
    from mptrain.training.run import run

    monkeypatch.chdir(tmp_path)
    taken = tmp_path / "outputs" / "tiny-tp1pp1-fp32"
    taken.mkdir(parents=True)
    (taken / "config.yaml").write_text("x: 1\n")
    (taken / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
    missing = ["data=indexed", f"data.prefixes=[{tmp_path}/nope]", "train.train_iters=1"]
    for overrides in (missing, [*missing, f"run.dir={tmp_path}/r"]):
        with pytest.raises(ConfigError, match=rf"^{tmp_path}/nope.idx: no such file"):
            run(compose(overrides))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["tiny-tp1pp1-fp32"]
    assert sorted(p.name for p in taken.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert "run.dir" not in capsys.readouterr().err


def test_checkpoint_paths_checked_at_start(tmp_path):
    from mptrain.training.run import run

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="checkpoint.save=.* is a file"):
        run(compose([f"checkpoint.save={afile}", f"run.dir={tmp_path}/a"]))
    with pytest.raises(ConfigError, match="checkpoint.load=.* does not exist"):
        run(compose([f"checkpoint.load={tmp_path}/typo", f"run.dir={tmp_path}/b"]))


def test_empty_eval_split_writes_no_rows_and_zero_iterations_one_valid_row(tmp_path):
    base = ["model=tiny", "train.eval_interval=2", "train.eval_iters=1"]
    run_distributed(run_job, 1, base + ["data=shakespeare", "data.split='90,0,10'", "train.train_iters=2",
                                        f"run.dir={tmp_path}/a"])
    assert read_rows(tmp_path / "a", "valid") == []
    assert [r["iteration"] for r in read_rows(tmp_path / "a", "test")] == [2]
    run_distributed(run_job, 1, base + ["train.train_iters=0", f"run.dir={tmp_path}/b"])
    assert [r["iteration"] for r in read_rows(tmp_path / "b", "valid")] == [0]
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line)["split"] == "valid" for line in lines)
