"""The README's main job (experiment=shakespeare_cpu: real text, tp2 × pp2 on 4 processes) equals the
tp1pp1 math step by step with dropout 0 (the project's first milestone)."""

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job

SHORT = ["experiment=shakespeare_cpu", "train.train_iters=4", "train.eval_interval=2", "train.eval_iters=1"]


def test_main_job_tp2pp2_equals_tp1pp1_on_real_text(tmp_path):
    run_distributed(run_job, 4, SHORT + [f"run.dir={tmp_path / 'tp2pp2'}"], timeout_s=300)
    run_distributed(run_job, 1, SHORT + ["parallel=tp1pp1", f"run.dir={tmp_path / 'tp1pp1'}"], timeout_s=300)
    for split in ("train", "valid"):
        a, b = read_rows(tmp_path / "tp2pp2", split), read_rows(tmp_path / "tp1pp1", split)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):  # DESIGN.md §3 tolerances (fp32, dropout 0 in model=tiny)
            assert x["lm_loss"] == pytest.approx(y["lm_loss"], rel=1e-5), (split, x, y)
            if split == "train":
                assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    valid = read_rows(tmp_path / "tp2pp2", "valid")
    assert [r["iteration"] for r in valid] == [0, 2, 4]
    assert valid[-1]["lm_loss"] < valid[0]["lm_loss"]  # it learns from the corpus already
