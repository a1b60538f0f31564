"""`python -m mptrain.from_megatron --cpu`: Megatron-LM's Llama 3 8B FP8 launch script (scaled down, tests/fixtures/megatron)
translated and trained on 4 CPU processes as printed, with the GPU-only choices in their CPU form."""

import json
from pathlib import Path

from mptrain.from_megatron import cpu_forms, main, world_size_of
from mptrain.megatron.shell import read_script
from mptrain.megatron.translate import translate

LLAMA = Path(__file__).resolve().parent / "fixtures" / "megatron" / "train_llama3_8b_h100_fp8.sh"


def test_cpu_adds_the_cpu_forms_and_says_why(capsys):
    assert main(["--cpu", "--mock-data", str(LLAMA), "CK", "TB"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("precision.fp8_emulate=true \\\n    precision.fp8_gemm_filter=none")
    assert err.splitlines()[-2:] == [
        "# --cpu: added for a trial on CPU processes:",
        "#   precision.fp8_emulate=true precision.fp8_gemm_filter=none: CPUs have no FP8 GEMMs: torchao's emulation, "
        "on every linear (the size filter is for GPU speed)"]
    assert cpu_forms(["precision=bf16"]) == ([], [])


def test_llama3_8b_fp8_runs_on_4_cpu_processes(tmp_path):
    """The translation (--cpu --mock-data: tp2 dp2, sequence parallel, ZeRO-1 with overlapped gathers, FP8 emulated,
    RMSNorm with zero-centred gamma, decoupled LR, sample-based schedule) trains 2 iterations and saves."""
    from harness import run_distributed
    from train_utils import run_job

    launch = read_script(LLAMA.read_text(), [str(tmp_path / "ck"), str(tmp_path / "tb")])
    t = translate(launch.args, world_size=world_size_of(launch.launcher), mock_data=True)
    overrides = [*t.overrides, *cpu_forms(t.overrides)[0]]
    assert {"precision=fp8", "parallel.tensor_model_parallel_size=2", "model.apply_layernorm_1p=true",
            "model.normalization=RMSNorm", "optim.decoupled_lr=5.0e-4"} <= set(overrides)
    run_dir = tmp_path / "run"
    # the script's 1.95 billion samples scaled down to 2 iterations of its global batch of 4, and its 32 evaluation
    # iterations to 1 (suite time: the three evaluations, at iteration 0 and at the end, were 96 forward
    # iterations beside 2 training ones)
    assert "train.eval_iters=32" in overrides
    run_distributed(run_job, 4, [*overrides, f"run.dir={run_dir}", "train.train_samples=8", "train.eval_iters=1"],
                    timeout_s=300)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [(r["iteration"], r["consumed_samples"]) for r in train] == [(1, 4), (2, 8)]
    # evaluated at the start and at the end (the script's split 99,1,0 has no test rows)
    assert [(r["split"], r["iteration"]) for r in rows if r["split"] != "train"] == [("valid", 0), ("valid", 2)]
    assert all(r["lm_loss"] > 0 and r["grad_norm"] > 0 for r in train)
    assert (tmp_path / "ck" / "latest").read_text().strip() == "2"
