"""`mptrain.generate` (KV cache, greedy / sampling, TP) and its agreement with `transformers`.

The checkpoint is trained at tp1pp2 (so every load below reshards: pp 2 -> 1, tp 1 -> 1 or 2) on
mock data, with a vocabulary that pads differently at tp1 and tp2 (100 ids, divisible-by 64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from procs import run_python
from train_utils import run_job

REPO = Path(__file__).resolve().parents[1]
VOCAB = 100
SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32", "train.eval_interval=null",
         f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=64", f"data.vocab_size={VOCAB}",
         "train.global_batch_size=8", "train.micro_batch_size=4"]
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen")
    run_distributed(run_job, 2, SMALL + ["parallel=tp1pp2", "train.train_iters=20", "optim.lr=1e-2",
                                         f"run.dir={root / 'run'}", f"checkpoint.save={root / 'ckpt'}"])
    return root / "ckpt"


def _generate_task(rank: int, world: int, ckpt: str, prompt: list, kwargs: dict) -> list:
    from mptrain.generate import generate_ids, load_generator

    gen = load_generator(ckpt)  # tp = the world size
    try:
        return generate_ids(gen, prompt, **kwargs)
    finally:
        gen.groups.destroy()


def _cache_task(rank: int, world: int, ckpt: str, prompt: list) -> float:
    """max |cached - uncached| over the logits of every position (prefill 5, then one token at a time)."""
    from mptrain.generate import load_generator
    from mptrain.inference import KVCache, cached_forward, supports_kv_cache

    gen = load_generator(ckpt)
    try:
        model = gen.model
        assert supports_kv_cache(model)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = model(ids, torch.arange(len(prompt)).unsqueeze(0))  # [1, s, V_pad/tp], no cache
            cache = KVCache.empty(model, batch_size=1, max_len=len(prompt))
            parts = [cached_forward(model, ids[:, :5], 0, cache)]
            for i in range(5, len(prompt)):
                parts.append(cached_forward(model, ids[:, i:i + 1], i, cache))
        return float((torch.cat(parts, dim=1) - full).abs().max())
    finally:
        gen.groups.destroy()


def _fresh_cache_task(rank: int, world: int, model_keys: dict) -> float:
    """As `_cache_task`, on a randomly initialised model of ``model_keys`` (no checkpoint needed)."""
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.groups import build_groups
    from mptrain.inference import KVCache, cached_forward, supports_kv_cache
    from mptrain.layers.gpt import build_model_chunks

    groups = build_groups(world, 1, None)
    try:
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, **model_keys)
        model = build_model_chunks(cfg, ParallelConfig(tensor_model_parallel_size=world), groups, vocab_size=VOCAB)[0]
        model.eval()
        assert supports_kv_cache(model)
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            full = model(ids, torch.arange(len(PROMPT)).unsqueeze(0))
            cache = KVCache.empty(model, batch_size=1, max_len=len(PROMPT))
            parts = [cached_forward(model, ids[:, :3], 0, cache)]
            for i in range(3, len(PROMPT)):
                parts.append(cached_forward(model, ids[:, i:i + 1], i, cache))
        return float((torch.cat(parts, dim=1) - full).abs().max())
    finally:
        groups.destroy()


def test_kv_cache_with_rope_and_grouped_query_attention():
    keys = {"position_embedding_type": "rope", "num_query_groups": 2, "normalization": "RMSNorm", "activation": "swiglu"}
    for world in (1, 2):
        assert max(run_distributed(_fresh_cache_task, world, keys)) < 1e-5


def test_kv_cache_equals_full_recompute(ckpt):
    for world in (1, 2):
        # fp32; SDPA sums a shorter or masked key range in another order: 1e-5 on O(1) logits
        assert max(run_distributed(_cache_task, world, str(ckpt), PROMPT)) < 1e-5


def test_greedy_tp1_tp2_and_transformers_agree(ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    greedy = {"max_new_tokens": 16}
    tp1 = run_distributed(_generate_task, 1, str(ckpt), PROMPT, greedy)[0]
    tp2 = run_distributed(_generate_task, 2, str(ckpt), PROMPT, greedy)
    assert len(tp1) == 16 and tp2 == [tp1, tp1]
    uncached = run_distributed(_generate_task, 1, str(ckpt), PROMPT, {**greedy, "use_cache": False})[0]
    assert uncached == tp1
    out = tmp_path / "hf"
    proc = run_python(["-m", "mptrain.export", "--checkpoint", str(ckpt), "--output", str(out), "--format", "hf-gpt2"],
                      cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        # eos = the NullTokenizer's EOD (99); our loop stops there too
        seq = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0].tolist()
    assert [t for t in seq[len(PROMPT):] if t != VOCAB - 1] == tp1  # HF keeps the EOD it stopped at


def test_sampling_is_reproducible_and_uses_the_seed(ckpt):
    kw = {"max_new_tokens": 12, "temperature": 1.5, "top_k": 20, "top_p": 0.95}
    a, b, c = (run_distributed(_generate_task, 1, str(ckpt), PROMPT, {**kw, "seed": s})[0] for s in (1, 1, 2))
    assert a == b and a != c
    greedy = run_distributed(_generate_task, 1, str(ckpt), PROMPT, {"max_new_tokens": 12})[0]
    assert a != greedy  # T = 1.5 over 20 tokens really samples


def test_filter_logits_top_k_and_top_p():
    from mptrain.inference import filter_logits, sample_next

    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (ids 3, 0, 4, 1, 2)
    p = torch.tensor([[0.25, 0.0625, 0.0625, 0.5, 0.125]])
    logits = p.log()
    kept = lambda out: (out[0] > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [0, 3]
    assert kept(filter_logits(logits, top_k=4)) == [0, 1, 2, 3, 4]  # a tie at the 4th value keeps both
    assert kept(filter_logits(logits, top_p=0.5)) == [3]  # 0.5 alone reaches p
    assert kept(filter_logits(logits, top_p=0.6)) == [0, 3]  # 0.5 < 0.6: the next token joins
    assert kept(filter_logits(logits, top_p=0.75)) == [0, 3]  # mass before id 4 is 0.75: dropped
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 3, 4]
    assert kept(filter_logits(logits, top_p=0.01)) == [3]  # the most probable token always stays
    # top_p acts on the top_k survivors renormalised (4/7, 2/7, 1/7): the mass before id 4 is 6/7
    assert kept(filter_logits(logits, top_k=3, top_p=0.8)) == [0, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.9)) == [0, 3, 4]
    assert torch.equal(filter_logits(logits, top_k=2)[0, [0, 3]], logits[0, [0, 3]])  # kept values unchanged
    assert sample_next(logits).tolist() == [3]  # temperature 0: argmax
    draws = [int(sample_next(logits, temperature=1.0, top_p=0.6, generator=torch.Generator().manual_seed(s)))
             for s in range(200)]
    assert set(draws) == {0, 3} and 0.55 < draws.count(3) / 200 < 0.8  # renormalised 2/3 : 1/3


def test_cli_prints_json_and_rejects_a_long_request(ckpt):
    want = run_distributed(_generate_task, 1, str(ckpt), [], {"max_new_tokens": 8})[0]
    cmd = ["-m", "mptrain.generate", "--checkpoint", str(ckpt), "--max-new-tokens", "8", "--json"]
    proc = run_python(cmd, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["prompt_ids"] == [] and row["new_ids"] == want  # an empty prompt starts from EOD
    proc = run_python(cmd[:4] + ["--prompt", "1 2 3", "--max-new-tokens", "4", "--json"], cwd=REPO, timeout=120)
    row = json.loads(proc.stdout)
    assert row["prompt_ids"] == [1, 2, 3] and len(row["new_ids"]) == 4
    # ids in, ids out: the prompt's last id and the first new one stay apart
    assert row["text"].split() == [str(i) for i in [1, 2, 3] + row["new_ids"]], row
    proc = run_python(cmd[:4] + ["--prompt", "1 2 3", "--max-new-tokens", "40"], cwd=REPO, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: --max-new-tokens=40 + prompt length 3 = 43 exceeds the model's 32 positions "
                                   "(model.max_position_embeddings / seq_length); lower --max-new-tokens or shorten "
                                   "the prompt")


def test_a_text_prompt_on_a_mock_data_checkpoint_is_one_line_before_any_process_group(ckpt, capsys):
    """data=mock trains with NullTokenizer (no text): a text prompt is refused naming the fix, an id prompt
    out of the vocabulary too, and no process group was started."""
    import torch.distributed as dist

    from mptrain.generate import main

    assert main(["--checkpoint", str(ckpt), "--prompt", "hello world"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: --prompt 'hello world': the checkpoint's data.tokenizer is NullTokenizer (no text: trained "
                   "on data=mock), which reads token ids only; pass ids such as --prompt '1 2 3', or train with a text "
                   "tokenizer (data.tokenizer, e.g. data=shakespeare's ByteTokenizer)\n")
    assert main(["--checkpoint", str(ckpt), "--prompt", f"1 {VOCAB}"]) == 1
    assert capsys.readouterr().err == (f"error: --prompt: token ids [{VOCAB}] are outside the vocabulary [0, {VOCAB}); "
                                       f"pass ids below {VOCAB}\n")
    assert not dist.is_initialized()


def test_a_corrupt_shard_is_one_line_before_any_process_group(ckpt, tmp_path, capsys):
    """generate verifies the folder against its manifest.json as training does: a flipped byte in a shard
    is one error line naming the file, and nothing is decoded."""
    import shutil
    import zlib

    import torch.distributed as dist

    from mptrain.generate import main

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    folder = copy / f"iter_{int((copy / 'latest').read_text()):07d}"
    shard = sorted(folder.glob("__*.distcp"))[0]
    want = json.loads((folder / "manifest.json").read_text())["files"][shard.name]["crc32"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    got = f"{zlib.crc32(bytes(data)) & 0xFFFFFFFF:08x}"
    assert main(["--checkpoint", str(copy), "--prompt", "1 2 3", "--max-new-tokens", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: --checkpoint: {shard} is corrupt (crc32 {got}, the manifest says {want}); restore "
                            "the file from an intact copy of the checkpoint, or read another saved iteration "
                            "(--iteration N)\n")
    assert not dist.is_initialized()


def test_a_process_count_the_heads_do_not_divide_names_the_launch(ckpt, monkeypatch):
    """Three processes for a 4-head model: the fix is the launch's process count (generate has no parallel=
    key); raised before any process group, it is alike on every rank: `report_and_exit` with symmetric=True
    (rank 0 prints it, the others wait for that before they exit)."""
    import torch.distributed as dist

    from mptrain import generate, groups

    reported = []

    def report(line, *, rank, world_size, symmetric):
        reported.append((line, rank, world_size, symmetric))
        raise SystemExit(1)

    monkeypatch.setattr(generate, "report_and_exit", report)
    for rank in (0, 1):
        monkeypatch.setattr(groups, "read_dist_env", lambda: groups.DistEnv(rank=rank, world_size=3))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        with pytest.raises(SystemExit):
            generate.main(["--checkpoint", str(ckpt), "--prompt", "1 2 3"])
    line = ("error: --tensor-model-parallel-size=3: the checkpoint's model does not split over 3 ranks "
            "(model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=3); launch with a "
            "--nproc_per_node that divides it")
    assert reported == [(line, 0, 3, True), (line, 1, 3, True)]
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    """An MoE model trained at tp 2 with sequence parallelism (experts split over TP: ETP 2)."""
    root = tmp_path_factory.mktemp("gen_moe")
    run_distributed(run_job, 2, ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32",
                                 "model.moe_ffn_hidden_size=32", "train.eval_interval=null", f"model.vocab_size={VOCAB}",
                                 "model.make_vocab_size_divisible_by=64", f"data.vocab_size={VOCAB}",
                                 "train.global_batch_size=4", "train.micro_batch_size=4", "parallel=tp2pp1",
                                 "parallel.sequence_parallel=true", "train.train_iters=6", "optim.lr=1e-2",
                                 f"run.dir={root / 'run'}", f"checkpoint.save={root / 'ckpt'}"])
    return root / "ckpt"


def test_moe_greedy_at_tp2_equals_tp1(moe_ckpt):
    """Decoding an MoE model at tp 2 (no sequence parallelism for one token at a time: every TP rank holds every
    expert whole, resharded from the checkpoint's ETP 2, and routes every token) gives tp 1's greedy tokens."""
    greedy = {"max_new_tokens": 12}
    tp1 = run_distributed(_generate_task, 1, str(moe_ckpt), PROMPT, greedy)[0]
    tp2 = run_distributed(_generate_task, 2, str(moe_ckpt), PROMPT, greedy)
    assert len(tp1) == 12 and len(set(tp1)) > 1 and tp2 == [tp1, tp1]
