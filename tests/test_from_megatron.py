"""python -m mptrain.from_megatron: Megatron-LM launch scripts as mptrain commands.

The fixtures are Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh and
examples/llama/train_llama3_8b_h100_fp8.sh scaled down (sizes only). The integration test runs the
175B translation with the translator's --mock-data (the script's GPT-2 corpus and tokenizer files
are not shipped): its data arguments become data=mock, everything else runs as translated.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from mptrain.config.schema import Config
from mptrain.config.suggest import known_keys
from mptrain.from_megatron import main, table_markdown, world_size_of
from mptrain.megatron.shell import ScriptError, read_script
from mptrain.megatron.table import ROWS
from mptrain.megatron.translate import MissingValues, translate

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
GPT3 = FIXTURES / "train_gpt3_175b_distributed.sh"
LLAMA = FIXTURES / "train_llama3_8b_h100_fp8.sh"
GPT3_ARGS = ["CKPT", "TB", "VOCAB", "MERGES", "DATA"]  # the script's $1..$5

GPT3_OVERRIDES = [
    "precision=fp16", "optim=adamw", "data=indexed", "logger=tensorboard",
    "model.num_layers=4", "model.hidden_size=128", "model.num_attention_heads=8", "model.seq_length=64",
    "model.max_position_embeddings=64", "train.micro_batch_size=1", "train.global_batch_size=4",
    'train.step_batch_size_schedule="0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"', "train.train_iters=2",
    "optim.weight_decay=0.1", "optim.adam_beta1=0.9", "optim.adam_beta2=0.95",
    "model.init_method_std=0.006", "train.clip_grad=1.0", "optim.lr=6.0e-5", "optim.lr_decay_style=cosine",
    "optim.min_lr=6.0e-6", "optim.lr_warmup_fraction=.001", "optim.lr_decay_iters=2",
    "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
    "data.prefixes=[DATA]",
    "++data.tokenizer={_target_:mptrain.data.tokenizers.GPT2BPETokenizer,vocab_file:VOCAB,merge_file:MERGES}",
    'data.split="949,50,1"', "train.log_interval=100", "checkpoint.save_interval=10000",
    "train.eval_interval=1000", "checkpoint.save=CKPT", "checkpoint.load=CKPT", "train.eval_iters=1",
    "logger.tensorboard_dir=TB",
    # Megatron's defaults where mptrain's differ
    "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.timing_log_level=0",
]
GPT3_UNCARRIED = []

LLAMA_UNCARRIED = ["--empty-unused-memory-level", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
                   "--tiktoken-pattern", "--no-mmap-bin-files", "--num-workers"]
LLAMA_NOTHING = ["--use-mcore-models", "--group-query-attention", "--attention-backend fused",
                 "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--context-parallel-size 1",
                 "--tokenizer-type NullTokenizer", "--no-create-attention-mask-in-dataloader", "--log-throughput",
                 "--ckpt-format torch_dist"]


def _translate(script: Path, positional=(), **kw):
    launch = read_script(script.read_text(), positional)
    assert launch.script == "pretrain_gpt.py"
    return launch, translate(launch.args, world_size=world_size_of(launch.launcher), **kw)


def test_gpt3_175b_translation():
    launch, t = _translate(GPT3, GPT3_ARGS)
    assert launch.launcher == ["torchrun", "--nproc_per_node", "4", "--nnodes", "1", "--master_addr", "localhost",
                               "--master_port", "29500"]
    assert t.overrides == GPT3_OVERRIDES
    assert [u[0] for u in t.uncarried] == GPT3_UNCARRIED
    assert [n[0] for n in t.nothing] == ["--attention-backend auto", "--merge-file MERGES"]
    from train_utils import compose  # the quoted override composes to Megatron's one string

    schedule = next(o for o in t.overrides if o.startswith("train.step_batch_size_schedule="))
    assert compose([schedule]).train.step_batch_size_schedule == "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"


def test_llama3_8b_fp8_translation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the script's DATA_CACHE_PATH is ${PWD}/benchmark_cache_llama3_8b_fp8
    launch, t = _translate(LLAMA)
    assert world_size_of(launch.launcher) == 4
    expected = [
        "precision=fp8", "optim=adamw", "data=mock", "logger=tensorboard",
        "model.num_layers=4", "model.hidden_size=128", "model.ffn_hidden_size=448", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.kv_channels=32", "model.seq_length=64", "model.max_position_embeddings=64",
        "model.position_embedding_type=rope", "model.rotary_base=1000000", "model.rotary_percent=1.0",
        "model.attention_dropout=0.0", "model.hidden_dropout=0.0", "model.activation=swiglu",
        "model.normalization=RMSNorm", "model.init_method_std=0.0134", "model.apply_layernorm_1p=true",
        "model.untie_embeddings_and_output_weights=true", "model.add_bias_linear=false",
        "train.micro_batch_size=1", "train.global_batch_size=4", "train.train_samples=1953125000", "train.train_iters=null",
        "optim.lr_decay_samples=1949218748", "optim.lr_warmup_samples=3906252", "optim.lr=0.00015",
        "optim.min_lr=0.00001", "optim.decoupled_lr=5.0e-4", "optim.decoupled_min_lr=4.5e-5",
        "optim.lr_decay_style=cosine", "train.clip_grad=1.0", "optim.weight_decay=0.1",
        "optim.adam_beta1=0.9", "optim.adam_beta2=0.95", "parallel.grad_reduce_in_fp32=false",
        "train.manual_gc=true", "train.exit_duration_in_mins=235", "parallel.use_distributed_optimizer=true",
        "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
        "model.vocab_size=1024", f"data.cache_dir={tmp_path}/benchmark_cache_llama3_8b_fp8", 'data.split="99,1,0"',
        "train.log_interval=1", "train.eval_iters=32", "train.eval_interval=100", "checkpoint.save_interval=1000",
        "train.profile=true", "train.profile_step_start=4", "train.profile_step_end=6", "train.timeout_s=3600", "checkpoint.save=checkpoints/llama3_8b_fp8", "checkpoint.load=checkpoints/llama3_8b_fp8",
        "logger.tensorboard_dir=tensorboard_logs/llama3_8b_fp8",
        "train.timing_log_level=0",  # Megatron's default
    ]
    assert t.overrides == expected
    assert sorted(u[0] for u in t.uncarried) == sorted(LLAMA_UNCARRIED)
    assert [n[0] for n in t.nothing] == LLAMA_NOTHING


def test_real_data_branch_of_the_llama_script(tmp_path, monkeypatch):
    """The script's else branch (a tokenizer and a data prefix as $3 $4): Hugging Face tokenizer, indexed data."""
    monkeypatch.chdir(tmp_path)
    _, t = _translate(LLAMA, ["ck", "tb", "/tok", "/data/corpus_text_document"])
    assert "data=indexed" in t.overrides and "data=mock" not in t.overrides
    assert "data.prefixes=[/data/corpus_text_document]" in t.overrides
    assert "++data.tokenizer={_target_:mptrain.data.tokenizers.HFTokenizer,tokenizer_json:/tok/tokenizer.json}" in t.overrides
    assert "checkpoint.save=ck" in t.overrides


def test_megatron_defaults_are_written_where_mptrain_differs():
    t = translate(["--num-layers", "2", "--micro-batch-size", "2", "--train-iters", "50", "--bf16",
                   "--tensor-model-parallel-size", "2", "--swiglu", "--hidden-size", "128"], world_size=16)
    written = dict(o.split("=", 1) for _, o in t.defaults)
    assert written == {"model.ffn_hidden_size": "320", "model.hidden_dropout": "0.1", "model.attention_dropout": "0.1",
                       "parallel.grad_reduce_in_fp32": "true", "optim": "adamw", "optim.lr_decay_iters": "50",
                       "optim.lr_decay_style": "linear", "train.global_batch_size": "16", "train.log_interval": "100",
                       "train.eval_interval": "null", "train.eval_iters": "100", "train.timing_log_level": "0"}
    # given: never overwritten by a default; --optimizer sgd: Megatron's sgd momentum 0.9
    t = translate(["--hidden-dropout", "0.0", "--optimizer", "sgd"])
    assert "model.hidden_dropout=0.0" in t.overrides and "optim=sgd" in t.overrides
    assert ("--sgd-momentum", "optim.sgd_momentum=0.9") in t.defaults


def test_switches_no_forms_precision_and_blends():
    t = translate(["--fp8-format", "hybrid", "--bf16", "--disable-bias-linear", "--no-load-optim",
                   "--data-path", "0.3", "/a/x", "0.7", "/b/y", "--recompute-num-layers", "1"])
    assert t.overrides[:2] == ["precision=fp8", "optim=adamw"]  # fp8 runs on bf16 params: --bf16 does not undo it
    assert {"model.add_bias_linear=false", "checkpoint.load_optim=false", "data.prefixes=[0.3,/a/x,0.7,/b/y]",
            "model.recompute_num_layers=1"} <= set(t.overrides)
    t = translate(["--fp8-format", "e4m3", "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p",
                   "--attention-backend", "unfused"])
    assert [(u[0], u[2]) for u in t.uncarried] == [("--fp8-format", "no equivalent yet"),
                                                  ("--cp-comm-type", "no equivalent yet")]
    assert {"model.attention_backend=unfused", "parallel.context_parallel_size=2"} <= set(t.overrides)
    t = translate(["--context-parallel-size", "4", "--cp-comm-type", "allgather", "allgather"])
    assert {"parallel.context_parallel_size=4", "parallel.cp_comm_type=all_gather"} <= set(t.overrides)
    assert [n[0] for n in translate(["--cp-comm-type", "p2p"]).nothing] == ["--cp-comm-type p2p"]
    assert "parallel.cp_comm_type=a2a" in translate(["--cp-comm-type", "a2a"]).overrides


def test_unknown_argument_by_name_or_uncarried():
    t = translate(["--async-tensor-model-parallel-allreduce", "--made-up-flag", "3"])
    assert t.by_name == [("--async-tensor-model-parallel-allreduce", "parallel.async_tensor_model_parallel_allreduce=true")]
    assert [(u[0], u[3]) for u in t.uncarried] == [("--made-up-flag", "not in the translation table")]


def test_shell_reading():
    script = r"""#!/bin/bash
A=${1:-"a b"}   # a comment
N=2; M=$((N*3))
ARR=( --x 1 # comment ( with parens )
      "--y 2"
)
ARR+=("--z '3,4'")
if [[ "$A" == "a b" ]] || [[ -z "$B" ]]; then
    ARR+=(--then)
elif [[ -n "$A" ]]; then
    ARR+=(--elif)
else
    ARR+=(--else)
fi
if [ ! -f /no/such/file.py ]; then
    echo "missing pretrain_gpt.py"
    exit 1
fi
CUDA_DEVICE_MAX_CONNECTIONS=1 python -m torch.distributed.run --nproc-per-node=$M \
    pretrain_gpt.py ${ARR[@]} "${ARR[@]}" --q "$A" --w $A
"""
    launch = read_script(script)
    assert launch.launcher == ["python", "-m", "torch.distributed.run", "--nproc-per-node=6"]
    assert launch.args == ["--x", "1", "--y", "2", "--z", "'3,4'", "--then",
                           "--x", "1", "--y 2", "--z '3,4'", "--then", "--q", "a b", "--w", "a", "b"]
    assert world_size_of(launch.launcher) == 6
    assert read_script(script, ["given"]).args[-4:] == ["--q", "given", "--w", "given"]
    with pytest.raises(ScriptError, match="no command of the script runs a .py program"):
        read_script("echo hello\n")
    with pytest.raises(ScriptError, match="not a bracket test"):
        read_script("if grep -q x y; then\n  X=1\nfi\n")


def test_table_keys_are_mptrain_keys():
    """Every key a row writes is in the schema."""
    known = set(known_keys(Config())) | {g for g in dataclasses.asdict(Config())}
    keys = {row.key for row in ROWS if row.key} | {
        o.partition("=")[0].lstrip("+") for row in ROWS if row.convert for o in _sample_overrides(row)}  # ++: Hydra's add
    assert sorted(keys - known) == []


def _sample_overrides(row) -> list:
    for sample in (["1"], ["hybrid"], ["adam"], ["unfused"], ["/p"]):
        try:
            return row.convert(sample, **row.read_from({"--merge-file": ["/m"]}))
        except Exception:  # noqa: BLE001 - a value the row does not take
            continue
    return []


def _tokenizer_translation(argv):
    return translate(argv, defaults_of=lambda groups: {})  # the data keys alone are read: no defaults composed


def test_vocab_and_merge_files_are_the_gpt2_bpe_tokenizer():
    """--vocab-file V --merge-file M (GPT2BPETokenizer, or no type: Megatron's GPT-2 examples give none) is
    mptrain's GPT2BPETokenizer on the same files; the override composes and builds the tokenizer."""
    from mptrain.data import build_tokenizer
    from mptrain.data.tokenizers import GPT2BPETokenizer
    from train_utils import compose

    fixture = ROOT / "tests" / "fixtures" / "gpt2_bpe"
    vocab, merges = str(fixture / "vocab.json"), str(fixture / "merges.txt")
    expected = f"++data.tokenizer={{_target_:mptrain.data.tokenizers.GPT2BPETokenizer,vocab_file:{vocab},merge_file:{merges}}}"
    for kind in ([], ["--tokenizer-type", "GPT2BPETokenizer"]):
        t = _tokenizer_translation(["--data-path", "D", *kind, "--merge-file", merges, "--vocab-file", vocab])
        assert [o for o in t.overrides if "data" in o] == ["data=indexed", "data.prefixes=[D]", expected]
        assert not t.uncarried
    tok = build_tokenizer(compose(["data=indexed", expected]).data)
    assert isinstance(tok, GPT2BPETokenizer) and (tok.vocab_size, tok.eod) == (385, 384)
    # --tokenizer-model's node composes alike (its keys replace the option's ByteTokenizer node)
    (hf_override,) = [o for o in _tokenizer_translation(["--tokenizer-model", "/tok"]).overrides if "data.tokenizer" in o]
    assert compose(["data=indexed", hf_override]).data.tokenizer == {
        "_target_": "mptrain.data.tokenizers.HFTokenizer", "tokenizer_json": "/tok/tokenizer.json"}
    cases = {"BertWordPieceLowerCase": ("no equivalent yet", "BERT's WordPiece vocabulary"),
             "HuggingFaceTokenizer": ("not needed in mptrain", "--tokenizer-type HuggingFaceTokenizer does not read --vocab-file")}
    for kind, (status, why) in cases.items():
        t = _tokenizer_translation(["--tokenizer-type", kind, "--vocab-file", "V", "--merge-file", "M"])
        assert [u[0] for u in t.uncarried] == ["--vocab-file"] and t.uncarried[0][2] == status and why in t.uncarried[0][3]
        assert not any("data.tokenizer" in o for o in t.overrides)
    t = _tokenizer_translation(["--vocab-file", "V"])
    assert t.uncarried == [("--vocab-file", "--vocab-file V", "no equivalent yet",
                            "GPT2BPETokenizer needs --merge-file beside --vocab-file (gpt2-merges.txt)")]
    t = _tokenizer_translation(["--mock-data", "--vocab-file", "V", "--merge-file", "M"])
    assert "data=mock" in t.overrides and [u[2] for u in t.uncarried] == ["not needed in mptrain"]


def test_doc_table_is_the_mapping():
    doc = (ROOT / "docs" / "MEGATRON.md").read_text()
    assert table_markdown() in doc, "docs/MEGATRON.md's table is stale: python -m mptrain.from_megatron --table"
    for row in ROWS:
        assert f"| `{row.flag}` |" in doc


def test_cli(capsys):
    assert main([str(GPT3), *GPT3_ARGS]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("torchrun --nproc_per_node 4 --nnodes 1 --master_addr localhost --master_port 29500 train.py \\\n")
    assert "    'data.split=\"949,50,1\"' \\\n" in out
    assert "    'train.step_batch_size_schedule=\"0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536\"' \\\n" in out
    assert "model.hidden_dropout=0.1  (--hidden-dropout unset)" in err and err.endswith("# not carried: none\n")
    assert main(["--world-size", "2", "--", "--num-layers", "2"]) == 0
    assert capsys.readouterr().out.startswith("torchrun --nproc_per_node=2 train.py \\\n    optim=adamw \\\n    model.num_layers=2 \\\n")
    assert main(["no_such_script.sh"]) == 1
    assert "no such script; put -- before Megatron's arguments" in capsys.readouterr().err


GPT3_USAGE = (f"pass them: python -m mptrain.from_megatron {GPT3} CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE "
              "MERGE_FILE DATA_PATH")


def test_an_argument_without_its_value_is_one_line_and_exit_2(capsys):
    """The script run without its own arguments: every argument its unset $N leaves without a value is named in
    one line with the script's usage (its variables' names), exit 2, nothing on stdout, no traceback."""
    assert main([str(GPT3)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"error: --data-path, --vocab-file, --merge-file, --save, --load, --tensorboard-dir got no value: "
                   f"{GPT3} reads 5 arguments of its own and was given 0; {GPT3_USAGE}\n")
    assert main(["--mock-data", str(GPT3), "CKPT", "TB"]) == 2
    assert capsys.readouterr().err == (f"error: --data-path, --vocab-file, --merge-file got no value: {GPT3} reads 5 "
                                       f"arguments of its own and was given 2; {GPT3_USAGE}\n")
    assert main(["--", "--num-layers", "2", "--save", "--lr", "1e-4"]) == 2
    assert capsys.readouterr().err == "error: --save got no value; give each its value after it (--save VALUE)\n"
    launch = read_script('CK=$1\npython pretrain_gpt.py --load "$CK" --save "$UNSET"\n', ["ck"])
    assert (launch.arguments, launch.given) == (("CK",), 1)
    with pytest.raises(MissingValues) as err:  # a quoted unset variable is an empty word: no value either
        translate(launch.args)
    assert err.value.flags == ["--save"]


def test_table_into_a_closed_pipe_prints_no_traceback(tmp_path):
    """`--table | head -3`: the reader is gone before the table is written; no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader left: the first write fails with EPIPE, as once head has read its lines
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    try:
        proc = subprocess.run([sys.executable, "-m", "mptrain.from_megatron", "--table"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_gpt3_175b_runs_on_4_cpu_processes(tmp_path):
    """The translation (with --mock-data) trains 2 iterations at tp2 pp2 on 4 gloo processes, each of the step
    schedule's first global batch (16 samples, its entry 0:16; --global-batch-size 4 is the evaluation's)."""
    from harness import run_distributed
    from train_utils import run_job

    _, t = _translate(GPT3, [str(tmp_path / "ckpt"), str(tmp_path / "tb"), "VOCAB", "MERGES", "DATA"], mock_data=True)
    assert t.replaced == ["--data-path DATA", "--vocab-file VOCAB"]  # data=mock keeps --split
    assert 'data.split="949,50,1"' in t.overrides
    run_dir = tmp_path / "run"
    run_distributed(run_job, 4, t.overrides + [f"run.dir={run_dir}"], timeout_s=300)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert [(r["global_batch_size"], r["num_microbatches"], r["consumed_samples"]) for r in train] == [(16, 16, 16),
                                                                                                    (16, 16, 32)]
    assert all(r["lm_loss"] > 0 for r in train)
    config = (run_dir / "config.yaml").read_text()
    assert re.search(r"hidden_dropout: 0\.1", config) and re.search(r"name: fp16", config)


def test_profiler_window_arguments_become_the_train_profile_keys():
    from train_utils import compose

    t = translate(["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "5",
                   "--profile-ranks", "0", "2"])
    assert t.uncarried == [] and t.nothing == []
    profile = [o for o in t.overrides if o.startswith("train.profile") or o.startswith("train.use_pytorch")]
    assert profile == ["train.profile=true", "train.use_pytorch_profiler=true", "train.profile_step_start=3",
                       "train.profile_step_end=5", "train.profile_ranks=[0,2]"]
    train = compose(profile).train  # Hydra reads the list as Megatron's nargs='+'
    assert (train.profile, train.use_pytorch_profiler, train.profile_step_start, train.profile_step_end,
            list(train.profile_ranks)) == (True, True, 3, 5, [0, 2])


def test_rampup_batch_size_is_carried():
    """Megatron's GPT-3 ramp (its 175B example before --step-batch-size-schedule) becomes train.rampup_batch_size."""
    t = translate(["--rampup-batch-size", "16", "16", "5859375", "--global-batch-size", "1536",
                   "--train-samples", "146484375"])
    assert {"train.global_batch_size=1536", "train.rampup_batch_size=[16,16,5859375]", "train.train_samples=146484375",
            "train.train_iters=null"} <= set(t.overrides)
    assert t.uncarried == []
    from train_utils import compose  # the override is one Hydra can compose: a list of three ints

    assert list(compose(["train.rampup_batch_size=[16,16,5859375]"]).train.rampup_batch_size) == [16, 16, 5859375]


def test_moe_layer_freq_takes_megatrons_list_expressions_without_eval():
    from mptrain.megatron.table import Uncarried, moe_layer_freq

    assert moe_layer_freq(["2"]) == ["model.moe_layer_freq=2"]
    assert moe_layer_freq(["[1,0,1]"]) == ["model.moe_layer_freq=[1,0,1]"]
    assert moe_layer_freq(["([0]+[1]*3)*2"]) == ["model.moe_layer_freq=[0,1,1,1,0,1,1,1]"]
    with pytest.raises(Uncarried, match="give an integer or a list of 0/1"):
        moe_layer_freq(["__import__('os').getcwd()"])
