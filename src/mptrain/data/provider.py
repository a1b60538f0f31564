"""DataProvider: the one object the trainer asks for micro-batches (docs/ARCHITECTURE.md "Batch").

Construction is collective over the default process group: global rank 0 builds everything that
is written to disk (the Shakespeare preprocessing on first use, the epoch-0 index caches), then
broadcasts success or its error message to every rank (a barrier that cannot hang when rank 0
fails: every rank raises the same `DataError`). Other ranks then open the same files read-only
(memory-mapped; all ranks must see one filesystem, as in Megatron). Ranks with
`needs_data=False` open nothing and yield `None` batches.

Data options (`data.name`, an exhaustive registry `SOURCES`):
- `mock`: `MockDataset` per split (no files);
- `indexed`: `data.prefixes` = `[prefix]` or `[w1, prefix1, w2, prefix2, ...]` (a blend), each
  split by documents with `data.split`;
- `shakespeare`: the shipped `data/shakespeare.jsonl.gz` (or `data.corpus`), preprocessed with
  the configured tokenizer into the cache folder, then as `indexed`.
Cache folder: `cache_root` argument, else `data.cache_dir`, else beside the data
(`<prefix dir>/mptrain_index_cache/`; for Shakespeare `<repo>/data/cache/`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch.distributed as dist

from mptrain.data.blended import BlendedDataset
from mptrain.data.collate import collate
from mptrain.data.errors import DataError
from mptrain.data.gpt_dataset import SPLITS, GPTDataset, parse_split, split_document_ranges
from mptrain.data.indexed import IndexedDataset
from mptrain.data.mock import MockDataset
from mptrain.data.sampler import PretrainingSampler
from mptrain.data.tokenizers import Tokenizer
from mptrain.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_CORPUS = REPO_ROOT / "data" / "shakespeare.jsonl.gz"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def parse_prefixes(prefixes: Any) -> list[tuple[float, str]]:
    """`[p]`, `[p1, p2]` (equal weights) or `[w1, p1, w2, p2, ...]` → [(weight, prefix), ...].

    Raises:
        ConfigError: empty, or a mix that is neither form (names `data.prefixes`).
    """
    items = list(prefixes or [])
    if not items:
        raise ConfigError("data.prefixes is empty; set data.prefixes=[PATH_PREFIX] (the --output-prefix of preprocessing)")

    def is_number(x: Any) -> bool:
        try:
            float(x)
            return not isinstance(x, bool)
        except (TypeError, ValueError):
            return False

    if not any(is_number(x) for x in items):
        return [(1.0, str(p)) for p in items]
    if len(items) % 2 or not all(is_number(w) and not is_number(p) for w, p in zip(items[::2], items[1::2])):
        raise ConfigError(f"data.prefixes={items}: give [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    return [(float(w), str(p)) for w, p in zip(items[::2], items[1::2])]


class DataProvider:
    """Micro-batches of this DP rank for train / valid / test.

    Args:
        data_cfg: the `data` config (DataConfig, DictConfig or dict).
        tokenizer: from `build_tokenizer(data_cfg)`.
        seq_length: s (tokens per sample; samples hold s + 1).
        micro_batch_size: b per DP rank.
        global_batch_size: G, a multiple of b × dp_size.
        dp_rank, dp_size: this rank's data-parallel coordinate.
        needs_data: False on ranks that read no batches (TP rank > 0, middle pipeline stages).
        cache_root: overrides `data.cache_dir` (where preprocessed data and index caches go).
    Raises:
        ConfigError: inconsistent batch sizes, bad `data.*` keys (checked on every rank first).
        DataError: bad or missing data files (raised on every rank).
    """

    def __init__(
        self,
        data_cfg: Any,
        *,
        tokenizer: Tokenizer,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        needs_data: bool,
        cache_root: Optional[str] = None,
    ) -> None:
        self.cfg, self.tokenizer = data_cfg, tokenizer
        self.name = str(_get(data_cfg, "name", "mock"))
        self.seq_length, self.micro_batch_size, self.global_batch_size = seq_length, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size, self.needs_data = dp_rank, dp_size, needs_data
        self.seed = int(_get(data_cfg, "seed", 1234))
        cache = cache_root if cache_root is not None else _get(data_cfg, "cache_dir")
        self.cache_root = Path(cache) if cache is not None else None
        self.samples_read = 0
        """Training samples this rank has read (for layout.json)."""
        self.eval_samples_read = 0
        self.sampler: Optional[PretrainingSampler] = None
        # Checks every rank makes before the collective (DESIGN.md §5).
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"train.global_batch_size={global_batch_size} is not divisible by train.micro_batch_size × dp = "
                f"{micro_batch_size} × {dp_size}; pick a multiple of {micro_batch_size * dp_size}"
            )
        if self.name not in SOURCES:
            raise ConfigError(f"data.name={self.name!r}: use one of {sorted(SOURCES)} (data=mock|indexed|shakespeare)")
        parse_split(_get(data_cfg, "split", "969,30,1"))
        if self.name == "indexed":
            parse_prefixes(_get(data_cfg, "prefixes"))
        if self.name == "mock" and int(_get(data_cfg, "vocab_size", 1000)) > tokenizer.vocab_size:
            raise ConfigError(
                f"data.vocab_size={_get(data_cfg, 'vocab_size')} exceeds the tokenizer's vocab_size="
                f"{tokenizer.vocab_size}; lower data.vocab_size or raise data.tokenizer.vocab_size"
            )
        self.splits = self._collective_build()

    # --- construction ------------------------------------------------------------------------
    def _collective_build(self) -> dict[str, Any]:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        splits, error, original, available = None, None, None, None
        if rank == 0:
            try:
                splits = SOURCES[self.name](self)
                for ds in splits.values():  # write the epoch-0 index caches now, once
                    for part in getattr(ds, "datasets", [ds]):
                        if isinstance(part, GPTDataset):
                            part.epoch_indices(0)
                available = {s: splits.get(s) is not None for s in SPLITS}
            except Exception as exc:  # noqa: BLE001 - every rank must learn that rank 0 failed
                error, original = f"{exc}" if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}", exc
        if distributed:
            box = [error, available]  # every rank learns rank 0's outcome (and which splits exist)
            dist.broadcast_object_list(box, src=0)
            error, available = box
        if error is not None:
            if original is not None:
                raise original
            raise DataError(f"rank 0 could not build the data: {error}")
        self.available: dict[str, bool] = available
        if splits is None and self.needs_data:
            splits = SOURCES[self.name](self)
        return splits or {}

    def _index_cache(self, prefix: str) -> Path:
        return self.cache_root / "index" if self.cache_root is not None else Path(prefix).parent / "mptrain_index_cache"

    # --- iteration ---------------------------------------------------------------------------
    def has_split(self, split: str) -> bool:
        """Whether `split` has data (a small corpus can leave valid / test without documents)."""
        return self.available[split]

    def _dataset(self, split: str):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not self.available[split]:
            raise DataError(
                f"data.split={_get(self.cfg, 'split')!r} leaves the {split} split no documents "
                f"(data={self.name}); give it a larger share, e.g. data.split=90,5,5"
            )
        return self.splits.get(split)

    def _iterate(self, split: str, sampler: PretrainingSampler) -> Iterator[Optional[dict]]:
        ds = self._dataset(split) if self.needs_data else None  # None: this rank reads nothing
        eod = self.tokenizer.eod
        flags = {k: bool(_get(self.cfg, k, False)) for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")}
        for indices in sampler:
            if ds is None:
                yield None
                continue
            batch = collate([ds.sample(i) for i in indices], eod=eod, **flags)
            if split == "train":
                self.samples_read += len(indices)
            else:
                self.eval_samples_read += len(indices)
            yield batch

    def train_iterator(self, consumed_samples: int) -> Iterator[Optional[dict]]:
        """This DP rank's training micro-batches from `consumed_samples` on, forever.

        Yields:
            the micro-batch dict (docs/ARCHITECTURE.md "Batch"), or None when `needs_data` is False.
        Raises:
            ConfigError: consumed_samples not a multiple of micro_batch_size × dp_size.
            DataError: the train split is empty.
        """
        self.sampler = PretrainingSampler(
            micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            consumed_samples=consumed_samples,
        )
        self._dataset("train")  # raises on every rank alike when the split is empty
        return self._iterate("train", self.sampler)

    def eval_iterator(self, split: str) -> Iterator[Optional[dict]]:
        """Micro-batches of `split` ("valid" | "test") from its beginning (same rank slicing as train)."""
        if split not in ("valid", "test"):
            raise ValueError(f"eval split must be 'valid' or 'test', got {split!r}")
        self._dataset(split)
        sampler = PretrainingSampler(micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        return self._iterate(split, sampler)

    def state_dict(self) -> dict:
        """{"consumed_samples": samples taken by all DP ranks through the current train iterator}."""
        return self.sampler.state_dict() if self.sampler is not None else {"consumed_samples": 0}


# --- sources: data.name → builder of {split: dataset or None} --------------------------------------
def _build_mock(p: DataProvider) -> dict[str, Any]:
    vocab = int(_get(p.cfg, "vocab_size", 1000))
    return {s: MockDataset(vocab_size=vocab, seq_length=p.seq_length, seed=p.seed, split=s) for s in SPLITS}


def _build_from_prefixes(
    p: DataProvider, weighted: list[tuple[float, str]], index_cache: Optional[Path] = None
) -> dict[str, Any]:
    split = str(_get(p.cfg, "split", "969,30,1"))
    per_split: dict[str, list] = {s: [] for s in SPLITS}
    for weight, prefix in weighted:
        indexed = IndexedDataset(prefix)
        if indexed.num_documents == 0:
            raise DataError(f"{prefix}.idx: no documents; re-run preprocessing on a non-empty corpus")
        # Ids the tokenizer cannot produce mean the data was made with another tokenizer: the
        # embedding would index out of range (tp 1) or silently mask them (tp > 1).
        max_id = indexed.max_token_id()
        if max_id >= p.tokenizer.vocab_size:
            raise DataError(
                f"{prefix}.bin holds token id {max_id} but data.tokenizer has {p.tokenizer.vocab_size} ids: the data "
                f"was preprocessed with another tokenizer; set data.tokenizer to that one, e.g. "
                f"data.tokenizer._target_=mptrain.data.tokenizers.HFTokenizer +data.tokenizer.tokenizer_json=PATH"
            )
        for s, doc_range in split_document_ranges(split, indexed.num_documents).items():
            if doc_range[1] > doc_range[0]:
                ds = GPTDataset(
                    indexed, doc_range=doc_range, seq_length=p.seq_length, seed=p.seed, split=s,
                    shuffle=(s == "train"), eod=p.tokenizer.eod, cache_dir=index_cache or p._index_cache(prefix),
                )
                per_split[s].append((weight, ds))
    out: dict[str, Any] = {}
    for s, items in per_split.items():
        if not items:
            out[s] = None
        elif len(weighted) == 1:
            out[s] = items[0][1]
        else:
            out[s] = BlendedDataset([d for _, d in items], [w for w, _ in items])
    return out


def _build_indexed(p: DataProvider) -> dict[str, Any]:
    return _build_from_prefixes(p, parse_prefixes(_get(p.cfg, "prefixes")))


def _build_shakespeare(p: DataProvider) -> dict[str, Any]:
    from mptrain.data.preprocess import preprocess

    corpus = Path(_get(p.cfg, "corpus") or SHIPPED_CORPUS)
    if not corpus.is_file():
        raise DataError(f"{corpus}: the Shakespeare corpus is missing; set data.corpus=PATH/shakespeare.jsonl(.gz)")
    root = p.cache_root if p.cache_root is not None else REPO_ROOT / "data" / "cache"
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", p.tokenizer.fingerprint)
    stat = corpus.stat()
    prefix = root / f"{corpus.name.split('.')[0]}-{tag}-{stat.st_size}"
    if not Path(f"{prefix}.idx").is_file():
        print(f"data: preprocessing {corpus} into {prefix}.bin/.idx (first use)", file=sys.stderr)
        preprocess([str(corpus)], output_prefix=str(prefix), tokenizer=p.tokenizer, workers=1, overwrite=True, progress=False)
    return _build_from_prefixes(p, [(1.0, str(prefix))], index_cache=root / "index")


SOURCES: dict[str, Callable[[DataProvider], dict[str, Any]]] = {
    "mock": _build_mock,
    "indexed": _build_indexed,
    "shakespeare": _build_shakespeare,
}
"""data.name → builder of {split: dataset or None}."""
