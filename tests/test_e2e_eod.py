"""EOD handling end to end: `data=shakespeare data.eod_mask_loss=true` on real text, micro-batch
counts 1 and 8 and DP 1 and 2 give the same per-step lm_loss (and grad norm) through `run(cfg)`.

Why a derived corpus: the shipped corpus has 42 works of ~100k bytes, so at seq 32 an EOD falls in
about one sample in 4000 and three global batches would almost never mask anything. The test keeps
the text real and makes document boundaries frequent: each non-empty line of the first works is
one document (`data.corpus=`), so most 32-byte samples hold an EOD. `_masked_counts` checks from
the data itself that masking happens and that micro-batches of one global batch hold different
numbers of loss tokens — the case where averaging per micro-batch (or per DP rank) instead of over
the global batch's tokens (DESIGN.md §3) would give a different loss; a test without that spread
could not fail.

Tolerances (DESIGN.md §3): splitting the batch changes only the fp32 summation order of the loss
and of the gradient accumulation / DP sum: lm_loss rel 1e-5, grad_norm rel 1e-4.
"""

import gzip
import json
from pathlib import Path

import pytest

from harness import run_distributed
from train_utils import compose, read_rows, run_job

STEPS = 3
SEQ = 32
GBS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Lines of the first two works of the shipped corpus, one document per line (real text, frequent EODs)."""
    root = tmp_path_factory.mktemp("eod")
    shipped = Path(__file__).resolve().parents[1] / "data" / "shakespeare.jsonl.gz"
    with gzip.open(shipped, "rt") as f:
        works = [json.loads(next(f)) for _ in range(2)]
    lines = [line.strip() for w in works for line in w["text"].splitlines() if line.strip()]
    path = root / "lines.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return {"path": path, "cache": root / "cache", "runs": root / "runs", "documents": len(lines)}


def _data(corpus) -> list:
    return ["data=shakespeare", "data.eod_mask_loss=true", f"data.corpus={corpus['path']}",
            f"data.cache_dir={corpus['cache']}"]


def _base(corpus) -> list:
    return ["model=tiny", "model.num_layers=2", f"model.seq_length={SEQ}", "train.eval_interval=null",
            f"train.train_iters={STEPS}", f"train.global_batch_size={GBS}", *_data(corpus)]


def _masked_counts(rank, world, overrides):
    """Loss tokens (loss_mask sum) and EOD inputs of each of the first STEPS*GBS training samples (dp 1, b 1)."""
    from mptrain.data.provider import build_provider
    from mptrain.data.tokenizers import build_tokenizer

    cfg = compose(overrides)
    tok = build_tokenizer(cfg.data)
    provider = build_provider(cfg.data, tokenizer=tok, seq_length=SEQ, micro_batch_size=1, global_batch_size=GBS,
                            dp_rank=0, dp_size=1, needs_data=True)
    it = provider.train_iterator(0)
    out = []
    for _ in range(STEPS * GBS):
        batch = next(it)
        out.append((int(batch["loss_mask"].sum().item()), int((batch["tokens"] == tok.eod).sum().item())))
    return out


def test_data_masks_eod_and_micro_batches_differ(corpus):
    counts = run_distributed(_masked_counts, 1, _base(corpus), timeout_s=180)[0]
    loss_tokens = [c for c, _ in counts]
    eods = [e for _, e in counts]
    assert corpus["documents"] > 1000
    assert sum(eods) >= STEPS * GBS // 2  # EOD inputs occur often
    assert all(c == SEQ - e for c, e in counts)  # eod_mask_loss: exactly the EOD input positions are masked
    for step in range(STEPS):  # within each global batch, the micro-batches of 1 hold different token counts
        assert len(set(loss_tokens[step * GBS:(step + 1) * GBS])) > 1, loss_tokens


# name: (world = dp, micro_batch_size); micro-batches per DP rank = GBS / (mbs * dp), in the name
SPLITS = {"dp1_1mb": (1, 8), "dp1_8mb": (1, 1), "dp2_1mb": (2, 4), "dp2_4mb": (2, 1)}


def test_eod_mask_loss_same_loss_for_micro_batch_counts_1_and_8_and_dp_1_and_2(corpus, capsys):
    rows = {}
    for name, (world, mbs) in SPLITS.items():
        run_dir = corpus["runs"] / name
        run_distributed(run_job, world, _base(corpus) + ["parallel=tp1pp1", f"train.micro_batch_size={mbs}",
                                                         f"run.dir={run_dir}"], timeout_s=300)
        rows[name] = read_rows(run_dir)
        assert rows[name][0]["num_microbatches"] == GBS // (mbs * world)
    with capsys.disabled():
        for name, r in rows.items():
            print(f"\n  eod_mask_loss {name}: lm_loss {[x['lm_loss'] for x in r]}", end="")
        print()
    ref = rows["dp1_1mb"]
    assert [r["iteration"] for r in ref] == list(range(1, STEPS + 1))
    for name, got in rows.items():
        for x, y in zip(ref, got):
            assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (name, x["iteration"])
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), (name, x["iteration"])
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]  # the steps trained
