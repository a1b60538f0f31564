"""Start-up lines of train.log: which optimizer class / kernel and which norm run (the log
says which kernels run), whether sequence parallelism is on, and why evaluation skips a split,
phrased by what is configured."""

from __future__ import annotations

import pytest

from harness import run_distributed
from train_utils import compose, run_job

TINY = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.train_iters=1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=null"]


def _kernels_line(run_dir) -> str:
    lines = [line for line in (run_dir / "train.log").read_text().splitlines() if "kernels:" in line]
    assert len(lines) == 1, lines
    return lines[0][lines[0].index("kernels:"):]


EAGER = " compile=off (default: eager on cpu; model.compile_layers=true compiles)"  # model.compile_layers=null on CPU


@pytest.mark.parametrize("overrides, want", [
    ([], "kernels: optimizer=torch.optim.Adam (fused=True) norm=mptrain.layers.norms.LayerNorm "
         "(torch.nn.functional.layer_norm)" + EAGER),
    (["optim=sgd", "model.normalization=RMSNorm", "precision=bf16"],
     "kernels: optimizer=torch.optim.SGD (fused=True) norm=mptrain.layers.norms.RMSNorm (torch.nn.functional.rms_norm)"
     + EAGER),
    (["optim=adamw", "precision=bf16"],  # adamw's weight_decay is Megatron's 0.01
     "kernels: optimizer=torch.optim.AdamW (fused=True) weight_decay=0.01 decoupled (AdamW: p -= lr*wd*p) "
     "norm=mptrain.layers.norms.LayerNorm (torch.nn.functional.layer_norm)" + EAGER),
    (["optim.weight_decay=0.1"],  # optim=adam: torch's Adam, whose decay is not Megatron's adam's
     "kernels: optimizer=torch.optim.Adam (fused=True) weight_decay=0.1 coupled (L2: wd*p added to the gradient; "
     "Megatron's --optimizer adam decouples it: optim=adamw) norm=mptrain.layers.norms.LayerNorm "
     "(torch.nn.functional.layer_norm)" + EAGER),
    (["optim._target_=torch.optim.RMSprop", "parallel.sequence_parallel=true"],  # takes foreach but not fused
     "kernels: optimizer=torch.optim.RMSprop (foreach=True) norm=mptrain.layers.norms.LayerNorm "
     "(torch.nn.functional.layer_norm)" + EAGER),
])
def test_train_log_names_the_optimizer_kernel_and_the_norm(tmp_path, overrides, want):
    run_distributed(run_job, 1, TINY + overrides + [f"run.dir={tmp_path}"])
    assert _kernels_line(tmp_path) == want
    job = [line for line in (tmp_path / "train.log").read_text().splitlines() if "job: " in line]
    sp = ("off (parallel.sequence_parallel=true has no effect at tp=1)" if "parallel.sequence_parallel=true" in overrides
          else "off")
    assert len(job) == 1 and f" sequence-parallel={sp} run.dir=" in job[0], job


def test_weight_decay_coupling_of_each_optimizer_class():
    """Coupled (L2 in the gradient) or decoupled (AdamW), read from the optimizer object, for the kernels: line."""
    import torch

    from mptrain.optim import weight_decay_coupling, weight_decay_note

    params = [torch.nn.Parameter(torch.zeros(2))]

    class Mine(torch.optim.Optimizer):  # a user's class that says nothing about its decay
        def __init__(self, params, weight_decay):
            super().__init__(params, {"weight_decay": weight_decay})

    assert [weight_decay_coupling(opt) for opt in (
        torch.optim.Adam(params, weight_decay=0.1), torch.optim.AdamW(params, weight_decay=0.1),
        torch.optim.SGD(params, lr=0.1, weight_decay=0.1), torch.optim.RMSprop(params, weight_decay=0.1),
        Mine(params, 0.1))] == ["coupled", "decoupled", "coupled", "coupled", None]
    assert weight_decay_note(torch.optim.Adam(params, weight_decay=0.0)) == ""
    assert weight_decay_note(torch.optim.SGD(params, lr=0.1, weight_decay=0.1)) == (
        " weight_decay=0.1 coupled (L2: wd*p added to the gradient)")
    assert weight_decay_note(Mine(params, 0.5)) == " weight_decay=0.5 (coupled or decoupled: Mine does not say)"


def test_empty_split_reason_follows_the_configured_data():
    from mptrain.data.provider import empty_split_reason

    held_out = compose(["data=indexed", "data.train_prefixes=[/x/a]", "data.valid_prefixes=[/x/b]"]).data
    assert empty_split_reason(held_out, "test") == "data.test_prefixes is empty"
    cut = compose(["data=indexed", "data.prefixes=[/x/a]", "data.split=[100,0,0]"]).data
    assert empty_split_reason(cut, "valid") == "data.split=[100, 0, 0] leaves the valid split empty"
    user = compose(["data._target_=mptrain_plugins.text_data.TextFileProvider", "+data.files=[/x/a.txt]"]).data
    assert empty_split_reason(user, "test") == ("data._target_=mptrain_plugins.text_data.TextFileProvider provides no "
                                                "test split")
