"""The benchmark harness (CPU): configs vs conf/model, the FLOP formula, result rows, the report table,
`run_bench.py --dry-run`, and one real CPU run of bench/mptrain_entry.py turned into a row."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import configs as bc  # noqa: E402
import report  # noqa: E402
import profile_report  # noqa: E402
import run_bench  # noqa: E402

ENV = {"gpu_name": "NVIDIA H200", "torch": "2.11.0", "time_utc": "2026-11-30T00:00:00Z"}


def test_model_shapes_match_conf():
    for name, shape in bc.MODEL_SHAPES.items():
        y = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
        assert (y.num_layers, y.hidden_size, y.num_attention_heads, y.seq_length) == (
            shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.seq_length), name
        assert y.get("vocab_size") in (shape.vocab_size, None), name  # tiny: null = the mock tokenizer's 1000


def test_flops_reproduce_the_peer_readme():
    # megatron-core's published rows for these configs (2 × H200, 2026-11-29): tokens/s/GPU -> TFLOP/s/GPU
    # with the same formula; they are rounded to 0.1 TFLOP/s, hence 0.05.
    b = bc.suite("full", 2, ["b_gpt1.3b_bf16_tp1"])[0]
    assert bc.padded_vocab(50257, 1) == 50304 and bc.padded_vocab(50257, 2) == 50432
    assert bc.flops_per_iteration(b) == 9073852416 * 16 * 2048  # (6·N + 12·L·h·s) per token × T
    per_token = bc.flops_per_iteration(b) / b.tokens_per_iteration
    assert abs(26214 * per_token / 1e12 - 237.9) < 0.05
    a = bc.suite("full", 2, ["a_seed_bf16_tp2"])[0]
    assert abs(22046 * bc.flops_per_iteration(a) / a.tokens_per_iteration / 1e12 - 360.2) < 0.05


def test_suites_by_gpu_count():
    assert [c.name for c in bc.suite("full", 1)] == ["b_gpt1.3b_bf16_tp1"]
    names2 = [c.name for c in bc.suite("full", 2)]
    assert names2 == ["b_gpt1.3b_bf16_tp1", "a_seed_bf16_tp2", "c_gpt1.3b_bf16_tp1pp2", "a_seed_fp32tf32_tp2", "a_seed_fp32_tp2"]
    assert [c.name for c in bc.suite("full", 4)] == names2 + ["d_gpt1.3b_bf16_tp2pp2"]
    c = bc.suite("full", 2, ["c_gpt1.3b_bf16_tp1pp2"])[0]
    assert (c.dp, c.global_batch_size, c.tokens_per_iteration) == (1, 16, 16 * 2048)
    with pytest.raises(ValueError, match="nope"):
        bc.suite("full", 2, ["nope"])
    with pytest.raises(ValueError, match="suite"):
        bc.suite("slow", 2)


def _cfg(**kw):
    base = dict(name="x", model="gpt_1.3b", gpus=1, tp=1, pp=1, micro_batch_size=4, num_microbatches=4,
                precision="bf16", warmup=2, iters=3)
    return bc.BenchConfig(**{**base, **kw})


def test_variants_option_puts_base_first(capsys):
    assert run_bench.main(["--suite", "full", "--gpus", "2", "--only", "a_seed_bf16_tp2", "--variants", "compile,base",
                           "--trainers", "mptrain", "--dry-run", "--call-id", "t"]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# mptrain")]
    assert [h.split("[")[1].split("]")[0] for h in heads] == ["base", "compile"]


def test_compare_losses_against_the_base_variant():
    base = {"lm_loss": [10.0, 9.0, 8.5]}
    row = {"lm_loss": [10.0, 9.25, 8.0]}
    run_bench.compare_losses(row, base)
    assert row["loss_max_abs_diff_vs_base"] == 0.5
    alone = {"lm_loss": [1.0]}
    run_bench.compare_losses(alone, None)
    run_bench.compare_losses(base, base)
    assert "loss_max_abs_diff_vs_base" not in alone and "loss_max_abs_diff_vs_base" not in base


def test_mptrain_row_drops_warmup_and_takes_max_peak():
    cfg = _cfg()
    T = cfg.tokens_per_iteration  # 32768
    # iteration times 9, 9 (warm-up), then 0.5, 0.6, 0.7 s; an eval row and an extra 6th row are ignored
    rows = [{"split": "train", "iteration": i + 1, "tokens_per_s": T / t, "lm_loss": 10.0 - i}
            for i, t in enumerate([9.0, 9.0, 0.5, 0.6, 0.7, 5.0])]
    rows.insert(2, {"split": "valid", "iteration": 2, "lm_loss": 1.0})
    peaks = [{"rank": 1, "peak_alloc_gib": 40.5}, {"rank": 0, "peak_alloc_gib": 41.25}]
    row = run_bench.mptrain_row(cfg, "base", rows, peaks, env=ENV, call_id="c1")
    assert row["iter_s_mean"] == 0.6  # (0.5 + 0.6 + 0.7) / 3
    assert row["tokens_per_s_per_gpu"] == round(T / 0.6, 1)
    assert row["tflops_per_gpu"] == round(bc.flops_per_iteration(cfg) / 0.6 / 1e12, 2)
    assert row["mfu"] == round(bc.flops_per_iteration(cfg) / 0.6 / 1e12 / 989.0, 4)
    assert row["peak_mem_gib"] == 41.25 and row["peak_alloc_gib_per_rank"] == [41.25, 40.5]
    assert (row["trainer"], row["config"], row["gpus"], row["gpu_name"], row["call_id"]) == ("mptrain", "x", 1, "NVIDIA H200", "c1")
    assert row["loss_first_last"] == [10.0, 5.0] and row["lm_loss"] == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]
    with pytest.raises(ValueError, match="timed train rows"):
        run_bench.mptrain_row(cfg, "base", rows[:4], peaks, env=ENV, call_id="c1")
    assert run_bench.mptrain_row(cfg, "base", rows, peaks, env={"gpu_name": "cpu"}, call_id="c")["mfu"] is None


def test_peer_and_ceiling_rows():
    cfg = _cfg(gpus=2, tp=1, pp=2, micro_batch_size=2, num_microbatches=8)
    result = {"iter_s_mean": 0.8, "iter_s_median": 0.79, "peak_alloc_gib_max": 37.456, "torch": "2.11.0+cu130",
              "megatron_core": "0.19.2", "tokens_per_s_per_gpu": 20480.0}
    row = run_bench.peer_row(cfg, result, env=ENV, call_id="c1")
    assert row["trainer"] == "megatron-core" and row["tokens_per_s_per_gpu"] == round(32768 / 0.8 / 2, 1)
    assert row["peak_mem_gib"] == 37.46 and row["megatron_core"] == "0.19.2" and row["torch"] == "2.11.0+cu130"
    c = run_bench.ceiling_row({"name": "compile_amp", "tokens_per_s": 59239.4, "tflops": 538.04, "mfu": 0.5440,
                               "peak_gib": 36.71, "iter_s": 0.553}, env=ENV, call_id="c1")
    assert (c["trainer"], c["config"], c["variant"], c["tokens_per_s_per_gpu"], c["mfu"]) == (
        "torch-ceiling", run_bench.CEILING_CONFIG, "compile_amp", 59239.4, 0.544)


def _row(trainer, config, variant, tps, **kw):
    r = {"trainer": trainer, "config": config, "variant": variant, "gpus": 2, "gpu_name": "NVIDIA H200", "call_id": "c1",
         "tokens_per_s_per_gpu": tps, "tflops_per_gpu": 100.0, "mfu": 0.1011, "peak_mem_gib": 30.0, "status": "ok",
         "layout": "tp2pp1dp1", "precision": "bf16", "tf32": False, "torch": "2.11.0", "command": f"cmd {trainer} {variant}"}
    r.update(kw)
    return r


def test_report_table_exact():
    rows = [_row("mptrain", "a", "base", 30000.0), _row("mptrain", "a", "compile", 33000.0),
            _row("megatron-core", "a", "base", 20000.0, peak_mem_gib=33.25),
            _row("mptrain", "f", "base", None, status="timeout", precision="fp32", tf32=True),
            _row("megatron-core", "f", "base", 9000.0, precision="fp32", tf32=True)]
    lines = report.call_table(rows)
    assert lines[0] == report.HEADER and lines[1].count("---") == 14
    assert lines[2:] == [
        "| a | 2 | tp2pp1dp1 | bf16 | base | 30,000 | 20,000 | 1.50× | 100.0 | 100.0 | 10.1 % | 10.1 % | 30.0 | 33.2 |",
        "| a | 2 | tp2pp1dp1 | bf16 | compile | 33,000 | 20,000 | 1.65× | 100.0 | 100.0 | 10.1 % | 10.1 % | 30.0 | 33.2 |",
        "| f | 2 | tp2pp1dp1 | fp32 + TF32 | base | timeout | 9,000 | – | timeout | 100.0 | timeout | 10.1 % | timeout | 30.0 |",
    ]
    rows[1]["invalid"] = "wrong grads"
    lines = report.call_table(rows)
    assert lines[3] == ("| a | 2 | tp2pp1dp1 | bf16 | compile ✗ | 33,000 | 20,000 | ~~1.65×~~ | 100.0 | 100.0 | 10.1 % "
                        "| 10.1 % | 30.0 | 33.2 |")
    assert lines[-2:] == ["", "✗ `a` [compile]: wrong grads  "]


def test_report_markdown_and_merge(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nhand-written intro\n\n" + report.BEGIN + "\nold\n" + report.END + "\n\n## Notes\nkeep me\n")
    res, new = tmp_path / "results.jsonl", tmp_path / "new.jsonl"
    rows = [_row("mptrain", "a", "base", 30000.0), _row("megatron-core", "a", "base", 20000.0)]
    res.write_text(json.dumps(rows[0]) + "\n")
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main(["--results", str(res), "--merge", str(new), "--md", str(md)]) == 0
    assert len(report.read_rows(res)) == 2  # the duplicate first row was not appended again
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written intro\n\n" + report.BEGIN)
    assert text.endswith(report.END + "\n\n## Notes\nkeep me\n") and "\nold\n" not in text
    assert "### call `c1`" in text and "| 1.50× |" in text and "cmd mptrain base" in text


def test_dry_run_prints_commands_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert run_bench.main(["--suite", "full", "--gpus", "2", "--dry-run", "--call-id", "t", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    cmds = [l for l in text.splitlines() if not l.startswith("#")]
    # probe + b(base, compile, peer, ceiling) + a bf16 (base, compile, peer) + c (base, compile, peer)
    # + tf32 (base, unfused_compile, peer) + fp32 (ours + peer)
    assert len(cmds) == 1 + 4 + 3 + 3 + 3 + 2
    b_ours = [c for c in cmds if "mptrain_entry.py" in c and "b_gpt1.3b_bf16_tp1-base" in c][0]
    for part in ("--nproc_per_node=1", "model=gpt_1.3b", "parallel=tp1pp1", "precision=bf16", "train.global_batch_size=16",
                 "train.micro_batch_size=4", "train.train_iters=11", "train.eval_interval=null", "data=mock"):
        assert part in b_ours.split(), part
    c_peer = [c for c in cmds if "peer_megatron.py" in c and "c_gpt1.3b" in c][0].split()
    assert c_peer[c_peer.index("--pp") + 1] == "2" and c_peer[c_peer.index("--num-microbatches") + 1] == "8"
    tf32_ours = [c for c in cmds if "a_seed_fp32tf32_tp2-unfused_compile" in c][0].split()
    assert "precision.allow_tf32=true" in tf32_ours and "parallel=tp2pp1" in tf32_ours
    assert "model.attention_backend=unfused" in tf32_ours and "model.compile_layers=true" in tf32_ours
    assert not any(part.startswith("env:") for c in cmds for part in c.split())  # env items are not overrides
    assert "model.compile_layers=true" in [c for c in cmds if "a_seed_bf16_tp2-compile" in c][0].split()
    assert "d_gpt1.3b" not in text and not out.exists()
    run_bench.main(["--suite", "full", "--gpus", "4", "--dry-run", "--call-id", "t", "--out", str(out)])
    assert "d_gpt1.3b_bf16_tp2pp2" in capsys.readouterr().out


def test_inductor_and_flag_items_become_entry_flags_not_overrides(tmp_path, capsys):
    """A variant's "inductor:" / "flag:" items reach mptrain_entry.py as its flags, before the overrides."""
    assert bc.variant_flags("default_stock_inductor") == ["--bench-inductor-choices", "stock"]
    assert bc.variant_flags("default_tiled_red") == [
        "--bench-inductor", "triton.tile_reductions=true,triton.prefer_nd_tiling=true"]
    assert bc.variant_flags("default") == []
    out = tmp_path / "r.jsonl"
    assert run_bench.main(["--suite", "small", "--gpus", "1", "--only", "s_gpt1.3b_mb4x4", "--variants",
                           "default_stock_inductor", "--no-reference", "--dry-run", "--out", str(out)]) == 0
    words = [c for c in capsys.readouterr().out.splitlines() if "mptrain_entry.py" in c][0].split()
    at = words.index("--bench-inductor-choices")
    assert words[at - 1].endswith("mptrain_entry.py") and words[at + 1] == "stock"
    assert not any(w.startswith(("flag:", "inductor:", "env:")) for w in words)


def test_cpu_run_of_the_entry_becomes_a_row(tmp_path):
    """One real job through torchrun + bench/mptrain_entry.py (tiny model, 1 gloo process). Its agent and worker
    are served warm (tests/warm_python.py; suite time: the entry's record and the row, not interpreter start-up,
    are the subject): the shim stands in for the interpreter, as `run_bench`'s ``python`` and torchrun's
    ``PYTHON_EXEC``."""
    from warm_python import warm_env

    python = warm_env({})["PYTHON_EXEC"]
    cfg = bc.BenchConfig("t", "tiny", 1, 1, 1, 2, 2, "fp32", warmup=1, iters=2)
    job = dict(kind="mptrain", cfg=cfg, trainer="mptrain", variant="base", run_dir=tmp_path / "run",
               log=tmp_path / "log.txt",
               argv=run_bench.torchrun(python, 1, ROOT / "bench" / "mptrain_entry.py",
                                       bc.mptrain_overrides(cfg, "base", str(tmp_path / "run"))))
    rc, _ = run_bench.run_process(job["argv"], job["log"], timeout_s=300, extra_env={"PYTHON_EXEC": python})
    assert rc == 0, job["log"].read_text()[-3000:]
    assert json.loads((tmp_path / "run" / "bench_rank0.json").read_text()) == {
        "rank": 0, "peak_alloc_gib": None, "peak_reserved_gib": None}  # CPU: no CUDA peak
    (row,) = run_bench.collect(job, env={"gpu_name": None}, call_id="cpu")
    assert row["status"] == "ok" and row["tokens_per_s_per_gpu"] > 0 and row["mfu"] is None
    assert row["tokens_per_iter"] == 2 * 2 * 64 and len(row["loss_first_last"]) == 2


def test_profile_runs_are_extra_jobs_with_variant_env(tmp_path):
    """--profile V adds a separate profiled run after variant V's measured one (its timings are not
    rows); an env: item of a variant reaches the job's environment, not the Hydra overrides."""
    cfgs = [dataclasses.replace(c, variants=("unfused_compile", "unfused_compile_noasync", "unfused_compile_cdmc1"))
            for c in bc.suite("full", 2, ["a_seed_fp32tf32_tp2"])]
    jobs = run_bench.plan(cfgs, suite_name="full", log_dir=tmp_path, python="python", trainers=("mptrain",),
                          profile=("unfused_compile_cdmc1",), probe=False)
    kinds = [(j["kind"], j["variant"]) for j in jobs]
    assert kinds == [("mptrain", "unfused_compile"), ("mptrain", "unfused_compile_noasync"),
                     ("mptrain", "unfused_compile_cdmc1"), ("profile", "unfused_compile_cdmc1")]
    assert jobs[2]["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and jobs[0]["env"] == {}
    assert "--bench-profile" in jobs[3]["argv"] and "--bench-profile" not in jobs[2]["argv"]
    assert run_bench.collect(jobs[3], env={}, call_id="t") == []


def test_kernel_categories_of_the_profile_split():
    """H200 kernel names from real profiles land in the intended categories (attention's
    CUTLASS kernels before GEMM, compiled Triton kernels apart from eager elementwise ones)."""
    cases = {
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "nccl",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "nccl send/recv (all-to-all, p2p)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention (flash/mem-efficient)",
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32": "gemm",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "multi-tensor (optimizer/unscale/norm)",
        "triton_poi_fused_gelu_gelu_backward_view_2": "triton (compiled)",
        "triton_poi_fused__scaled_mm__to_copy_clamp_mul_native_layer_norm_reciprocal_t_view_3": "triton (compiled)",
        "Memcpy DtoD (Device -> Device)": "copy/cast/fill",
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>>": "elementwise/reduce",
        "Command Buffer Full": "other",
    }
    assert {name: profile_report.kernel_category(name) for name in cases} == cases


def test_document_attention_bench_smoke(capsys):
    import document_attention

    rows = document_attention.main(["--smoke"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows and [r["variant"] for r in rows] == ["causal", "documents", "dense"]
    docs = rows[1]
    assert docs["backend"] == "per_document" and docs["max_abs_diff"] == 0.0 and docs["documents"] > 1
    assert all(r["time_ms"] > 0 and r["seq_length"] == 256 and "error" not in r for r in rows)
    assert docs["time_vs_causal"] == docs["time_ms"] / rows[0]["time_ms"]


def test_x8_suite_rows_calls_and_needs(tmp_path, monkeypatch, capsys):
    """The 8-GPU suite (no process starts): its rows, one `-m` job for the layout sweep, GPU jobs that keep
    a config with its megatron-core run and stay within the budget, and a row whose override names a key the
    config schema lacks marked ``needs`` with that key (the schema decides, here a schema without one key)."""
    import x8

    cfgs = bc.suite("x8", 8)
    names = [c.name for c in cfgs]
    # design 1, sweep 4, interleaved 2, scaling 2 × (1 + 3 × 4 + HSDP) = 28, CP 6, EP 3
    assert len(names) == len(set(names)) == 44 and names[0] == "x8_seed_fp16_tp2pp4"
    seed = cfgs[0]
    assert (seed.layout, seed.precision, seed.warmup + seed.iters) == ("tp2pp4dp1", "fp16", 50)
    by_name = {c.name: c for c in cfgs}
    assert by_name["x8_gpt6.7b_tp4pp2vpp2"].layout == "tp4pp2vpp2dp1"
    assert by_name["x8_s128k_cp4"].layout == "tp1pp1cp4dp1" and by_name["x8_moe_tp2ep4"].layout == "tp2pp1dp4ep4"
    assert [c.gpus for c in cfgs if c.name.startswith("x8_gpt1.3b_n")] == [1] + [2] * 4 + [4] * 4 + [8] * 4 + [8]
    assert [c.name for c in bc.suite("x8", 2) if c.name.startswith("x8_gpt1.3b_n")] == [
        "x8_gpt1.3b_n1_ddp", "x8_gpt1.3b_n2_ddp", "x8_gpt1.3b_n2_zero1", "x8_gpt1.3b_n2_zero2", "x8_gpt1.3b_n2_zero3"]

    assert x8.needs(["model=tiny", "parallel.use_distributed_optimizer=true", "parallel.no_such_key=1"]) == [
        "parallel.no_such_key"]
    without_ep = x8.schema_keys() - {"parallel.expert_model_parallel_size"}
    monkeypatch.setattr(x8, "schema_keys", lambda: without_ep)
    jobs = run_bench.plan(cfgs, suite_name="x8", log_dir=tmp_path, python="python", trainers=run_bench.TRAINERS)
    needing = {j["cfg"].name for j in jobs if j["needs"] == ["parallel.expert_model_parallel_size"]}
    assert needing == {"x8_moe_ep8", "x8_moe_tp2ep4"}
    assert all(x8.estimate_s(j) == 0 for j in jobs if j["needs"]) and x8.estimate_s(jobs[0]) > 0

    (sweep,) = [j for j in jobs if j["kind"] == "sweep"]
    assert sweep["argv"][sweep["argv"].index(str(ROOT / "bench" / "mptrain_entry.py")) + 1] == "-m"
    assert "parallel=tp1pp8,tp2pp4,tp4pp2,tp8pp1" in sweep["argv"] and not any(a.startswith("schedule=") for a in sweep["argv"])
    calls = x8.split_calls(jobs)
    placed = [i for call in calls for i in call]
    assert sorted(set(placed)) == list(range(len(jobs)))  # every job runs
    again = {jobs[i]["cfg"].name for i in placed if placed.count(i) > 1}
    # a baseline whose rows span several calls runs in each of them (which ones depends on the rows the schema runs)
    spans: dict = {}
    for k, call in enumerate(calls):
        for i in call:
            if jobs[i]["kind"] == "mptrain" and jobs[i]["cfg"].baseline:
                spans.setdefault(jobs[i]["cfg"].baseline, set()).add(k)
    assert again and again == {b for b, ks in spans.items() if len(ks) > 1}
    calls_of = {i: {k for k, call in enumerate(calls) if i in call} for i in range(len(jobs))}
    ours = {c.name: i for i, j in enumerate(jobs) if j["kind"] in ("mptrain", "sweep") for c in j.get("cfgs") or [j["cfg"]]}
    peers = [i for i, j in enumerate(jobs) if j["kind"] == "peer"]
    assert len(peers) == 6
    for i in peers:  # megatron-core runs in the call of mptrain's run of the same config (the sweep's, for its layouts)
        assert calls_of[i] == calls_of[ours[jobs[i]["cfg"].name]]
    for call in calls:  # within the budget, and a baseline's run precedes the rows divided by it
        assert sum(x8.estimate_s(jobs[i]) for i in call) <= x8.CALL_BUDGET_S
        for pos, i in enumerate(call):
            if jobs[i]["kind"] == "mptrain" and jobs[i]["cfg"].baseline:
                assert ours[jobs[i]["cfg"].baseline] in call[:pos]
    assert run_bench.main(["--suite", "x8", "--plan", "--out", str(tmp_path / "r.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.count("## call ") == len(x8.split_calls(run_bench.plan(
        bc.suite("x8", 8), suite_name="x8", log_dir=tmp_path, python="python", trainers=run_bench.TRAINERS)))
    assert "--suite x8 --call 1 --out $OUT/results.jsonl" in out


def test_zero_suite_rows():
    """One GPU: every strategy at dp 1 divided by the DDP row, ZeRO-3 + full recompute with CPU offload divided by
    the same without; the overrides are the trainer's keys."""
    cfgs = {c.name: c for c in bc.suite("zero", 1)}
    assert list(cfgs) == [f"z_gpt1.3b_mb4x4_{s}" for s in ("ddp", "zero1", "zero2", "zero3")] + [
        f"z_{m}_zero3_full{o}_mb1x4" for m in ("gpt2.7b", "gpt6.7b") for o in ("", "_offload")]
    assert {c.layout for c in cfgs.values()} == {"tp1pp1dp1"}
    assert [c.baseline for n, c in cfgs.items() if n.startswith("z_gpt1.3b")] == [None] + ["z_gpt1.3b_mb4x4_ddp"] * 3
    offload = cfgs["z_gpt6.7b_zero3_full_offload_mb1x4"]
    assert offload.baseline == "z_gpt6.7b_zero3_full_mb1x4" and offload.recompute == "full"
    o = bc.mptrain_overrides(offload, "default", "run")
    assert {"parallel.data_parallel_sharding_strategy=optim_grads_params", "optim.optimizer_cpu_offload=true",
            "model.recompute_granularity=full", "model=gpt_6.7b"} <= set(o)


def test_moe_suite_runs_the_moe_peer_at_the_preset_and_the_routing_share(tmp_path):
    """Suite moe: mptrain's default command at moe_mixtral_small, then the plain-PyTorch MoE GPT with the preset's
    shape, experts, top-k, expert width and aux-loss coefficient, the routing-share job at one micro-batch's tokens,
    then gpt_1.3b beside the dense plain-PyTorch GPT; the share row divides by the same call's mptrain step."""
    cfgs = bc.suite("moe", 1)
    jobs = run_bench.plan(cfgs, suite_name="moe", log_dir=tmp_path, python="python", trainers=run_bench.TRAINERS)
    assert [(j["kind"], j["cfg"].model, Path(j["argv"][1]).name if j["kind"] != "mptrain" else j["variant"])
            for j in jobs] == [
        ("mptrain", "moe_mixtral_small", "default"), ("reference", "moe_mixtral_small", "torch_moe.py"),
        ("moe_share", "moe_mixtral_small", "moe_share.py"), ("mptrain", "gpt_1.3b", "default"),
        ("reference", "gpt_1.3b", "torch_ceiling.py")]
    env = jobs[1]["env"]
    assert {k: env[k] for k in ("LAYERS", "HIDDEN", "HEADS", "QUERY_GROUPS", "SEQ", "EXPERT_FFN", "EXPERTS", "TOPK",
                                "AUX_COEFF", "MBS", "M", "VOCAB", "VOCAB_PADDED")} == {
        "LAYERS": "12", "HIDDEN": "1024", "HEADS": "16", "QUERY_GROUPS": "8", "SEQ": "2048", "EXPERT_FFN": "3584",
        "EXPERTS": "8", "TOPK": "2", "AUX_COEFF": "0.01", "MBS": "4", "M": "8", "VOCAB": "32000",
        "VOCAB_PADDED": "32000"}
    assert jobs[2]["argv"][2:] == ["--tokens", "8192", "--hidden", "1024", "--ffn", "3584", "--experts", "8",
                                   "--topk", "2"]
    row = run_bench.moe_share_row(cfgs[0], {"layer_ms": 4.0, "experts_ms": 3.5, "routing_ms": 0.5,
                                            "routing_share_of_layer": 0.125}, env=ENV, call_id="c1")
    run_bench.share_of_step(row, {(cfgs[0].name, "default"): {"iter_s_mean": 0.6}})
    assert row["routing_share_of_step"] == round(0.5e-3 * 12 * 8 / 0.6, 4) and row["step_s"] == 0.6


def test_moe_peer_routes_and_computes_as_the_mptrain_layer(monkeypatch):
    """`bench/peer/torch_moe.py`'s MoE (top-k + softmax over the k, argsort permutation, grouped GEMMs, Switch aux
    loss) computes mptrain's `MoELayer` function: same weights -> same output and the same grads, the aux loss's
    included (fp32 on CPU)."""
    import importlib

    import torch
    from mptrain.checkpoint.offline import single_rank_groups
    from mptrain.config.model import ModelConfig
    from mptrain.layers.context import LayerContext
    from mptrain.layers.moe import MoELayer
    from mptrain.layers.random import ParamInit

    for key, value in {"HIDDEN": "32", "EXPERT_FFN": "16", "EXPERTS": "4", "TOPK": "2", "AUX_COEFF": "0.01"}.items():
        monkeypatch.setenv(key, value)
    sys.path.insert(0, str(ROOT / "bench" / "peer"))
    try:
        peer = importlib.reload(importlib.import_module("torch_moe"))
    finally:
        sys.path.remove(str(ROOT / "bench" / "peer"))
    peer.BF16 = torch.float32  # the fp32 comparison: no casts
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=16, add_bias_linear=False, activation="swiglu", moe_aux_loss_coeff=0.01,
                      moe_router_dtype="fp32")
    ctx = LayerContext(groups=single_rank_groups(), init=ParamInit(seed=3, std=0.5, num_layers=1))
    ours, theirs = MoELayer(cfg, ctx, layer_number=0).train(), peer.MoE()
    with torch.no_grad():
        theirs.router.copy_(ours.router.weight)
        theirs.w1.copy_(ours.experts.linear_fc1.weight)
        theirs.w2.copy_(ours.experts.linear_fc2.weight)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1, 32, generator=gen)
    g = torch.randn(24, 1, 32, generator=gen)
    (ours(x) * g).sum().backward()  # the aux loss's grad joins through the router (scale 1)
    out, aux = theirs(x.reshape(24, 32))
    ((out.view(24, 1, 32) * g).sum() + aux).backward()
    torch.testing.assert_close(out.view(24, 1, 32), ours(x).detach(), rtol=1e-5, atol=1e-6)
    for mine, other in ((ours.router.weight, theirs.router), (ours.experts.linear_fc1.weight, theirs.w1),
                        (ours.experts.linear_fc2.weight, theirs.w2)):
        torch.testing.assert_close(other.grad, mine.grad, rtol=1e-5, atol=1e-6)
