"""Dataset providers: the one object the trainer asks for micro-batches (docs/COMPONENTS.md
"Dataset provider", docs/ARCHITECTURE.md "Batch").

One interface, `DatasetProvider`, and its `ComponentKind`, `DATASET_PROVIDER`. The `data` node
selects the class by `data._target_`; `build_provider` (the one place a provider is built) calls
`mptrain.components.build` with the runtime keywords (`RUNTIME_KEYWORDS`: tokenizer, sizes, DP
coordinate, `needs_data`) and offers every shared `data.*` key (`DATA_KEYWORDS`: seed, split,
prefixes, ...) to the target only when its signature takes it; a key added with `+data.x=...`
must be a keyword of the target.

Shipped options (each `conf/data/<option>.yaml` sets `_target_`):
- `mock` → `MockDataProvider`: `MockDataset` per split (no files);
- `indexed` → `IndexedDataProvider`: `data.prefixes` (`[prefix]` or a blend `[w1, p1, w2, p2, ...]`)
  cut into train/valid/test by documents with `data.split`, or separate corpora
  `data.train_prefixes` / `data.valid_prefixes` / `data.test_prefixes` (Megatron's
  --train-data-path / --valid-data-path / --test-data-path; each used whole, blends allowed);
- `shakespeare` → `ShakespeareDataProvider`: the shipped `data/shakespeare.jsonl.gz` (or
  `data.corpus`), preprocessed with the configured tokenizer into the cache folder, then as `indexed`.

Construction of the shipped providers is collective over the default process group: global rank
0 builds everything written to disk (the Shakespeare preprocessing on first use, the epoch-0
index caches), then broadcasts success or its error to every rank (a barrier that cannot hang
when rank 0 fails: every rank raises). Other ranks then open the same files read-only
(memory-mapped; all ranks must see one filesystem, as in Megatron). Ranks with
`needs_data=False` open nothing and yield `None` batches.
Cache folder: `data.cache_dir`, else beside the data (`<prefix dir>/mptrain_index_cache/`; for
Shakespeare `mptrain.resources.default_cache_dir()`: `data/cache/` in a checkout, the user's cache
folder for an installed package).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch.distributed as dist

from mptrain.components import ComponentKind, accepted_keywords, build, import_target, node_items, resolve
from mptrain.data.blended import BlendedDataset
from mptrain.data.collate import collate_arrays, read_samples
from mptrain.data.errors import DataError
from mptrain.data.gpt_dataset import SPLITS, GPTDataset, parse_split, split_document_ranges
from mptrain.data.indexed import IndexedDataset
from mptrain.data.mock import MockDataset
from mptrain.data.sampler import PretrainingSampler
from mptrain.data.tokenizers import TokenizerProtocol, check_tokenizer_record, recorded_eod, unrecorded_note
from mptrain.errors import ConfigError
from mptrain.resources import default_cache_dir, shipped_corpus



@runtime_checkable
class DatasetProvider(Protocol):
    """Micro-batches of one DP rank for train / valid / test: what the trainer reads, and nothing else.

    Construction (``__init__`` keywords, all passed by the trainer, `RUNTIME_KEYWORDS`):
        tokenizer: the built `data.tokenizer` (`TokenizerProtocol`).
        seq_length: s, tokens per sample (`model.seq_length`).
        micro_batch_size: b, samples per micro-batch of this DP rank.
        global_batch_size: G, samples per iteration over all DP ranks (a multiple of b × dp_size).
        dp_rank, dp_size: this rank's data-parallel coordinate; DP rank r must read its own slice.
        needs_data: False on ranks that read no batch (TP rank > 0, middle pipeline stages); their
            iterators may yield anything (`None`): the trainer never calls `next` on them.
    plus whichever shared `data.*` keys the signature names (`DATA_KEYWORDS`: `seed`, `split`, ...)
    and the user's own `+data.<key>` keywords.

    The constructor is called on every rank of the job at the same point, before training. It may
    use collectives on the default process group (the shipped providers do), and must then call
    the same ones on every rank (`needs_data=False` ranks included); an error must be raised on
    every rank alike (raise before any collective, or broadcast it as the shipped ones do), since
    a rank that raises alone leaves the others waiting in a collective until the timeout.

    Batches (what `train_iterator` / `eval_iterator` yield on a reading rank): a dict of
        tokens [b, s] int64, ids in [0, vocab_size): the model's input;
        labels [b, s] int64, ids in [0, vocab_size): the next token of each position;
        loss_mask [b, s] float32: 1 where the label counts, 0 where not (the loss is the mean over
            the global batch's masked tokens);
        position_ids [b, s] int64: position of each token (0..s-1, or restarting after EOD);
        cu_seqlens (optional) [b, s + 1] int64, the document boundaries (per sequence 0, each later
            document's start, then s repeated: `mptrain.layers.document_mask`), read only when
            `data.reset_attention_mask=true` (else the model's causal mask is used);
        attention_mask (optional) [b, 1, s, s] bool, True = masked, read instead of cu_seqlens when
            `data.create_attention_mask_in_dataloader=true` too.
    The reading rank (TP rank 0) checks every batch against this (shape, dtype, id range) before
    broadcasting it to its TP group; a mismatch ends the job with one line naming `data._target_`.
    Samples of the global batch of iteration i should depend only on the data config and i (not
    on the layout): that is what makes every layout train the same numbers (DESIGN.md §3).
    """

    def train_iterator(self, consumed_samples: int) -> Iterator[Optional[dict]]:
        """This DP rank's training micro-batches after `consumed_samples` samples (all DP ranks
        together, a multiple of b × dp_size) were consumed, forever (resume continues exactly)."""
        ...

    def eval_iterator(self, split: str) -> Iterator[Optional[dict]]:
        """Micro-batches of `split` ("valid" | "test") from its beginning; called again for each evaluation."""
        ...

    def has_split(self, split: str) -> bool:
        """Whether `split` has data; evaluation of a split without data is skipped. Same on every rank."""
        ...

    def state_dict(self) -> dict:
        """{"consumed_samples": ...} at least; informational (the checkpoint stores consumed samples)."""
        ...


RUNTIME_KEYWORDS = ("tokenizer", "seq_length", "micro_batch_size", "global_batch_size", "dp_rank", "dp_size", "needs_data")
DATASET_PROVIDER = ComponentKind(
    "dataset provider",
    methods=("train_iterator", "eval_iterator", "has_split", "state_dict"),
    runtime_keywords=RUNTIME_KEYWORDS,
    interface=DatasetProvider,
)
NOT_KEYWORDS = ("name", "tokenizer")
"""Schema fields of `data` that are never provider keywords (the option's name; the tokenizer is built apart)."""


def _schema_fields() -> tuple[str, ...]:
    from mptrain.config.data import DataConfig

    return tuple(f.name for f in dataclasses.fields(DataConfig) if f.name != "_target_")


def _data_keywords(data_cfg: Any) -> dict:
    """`DATA_KEYWORDS` of the node: every shared `data.*` key, offered to a provider that takes it."""
    items = node_items(data_cfg)
    return {k: items[k] for k in _schema_fields() if k in items and k not in NOT_KEYWORDS}


def check_data_config(data_cfg: Any) -> None:
    """The start-up checks of `data` (pure: config only; run by `validate_config` on every rank).

    Rules (one line each):
    - `data._target_` imports, has the `DatasetProvider` methods and takes the runtime keywords
      (`RUNTIME_KEYWORDS`); a `+data.<key>` is one of its keywords;
    - a corpus key that is set (`prefixes`, `train_prefixes`, `valid_prefixes`, `test_prefixes`,
      `corpus`) must be a keyword of the target (else it would be ignored silently);
    - `data.prefixes` (+ `data.split`) and the separate corpora `data.train_prefixes` /
      `valid_prefixes` / `test_prefixes` exclude each other; separate corpora need
      `train_prefixes`; valid / test may be empty (no such evaluation), train may not (a `data.split`
      train weight of 0, where the target takes ``split``); a target whose
      ``requires_prefixes`` is true (`IndexedDataProvider`) and that takes ``prefixes`` needs one of them;
    - each prefix list is `[p, ...]` or a blend `[w1, p1, w2, p2, ...]`; `data.split` parses;
    - `data.tokenizer._target_` imports, has `encode` / `decode`, takes its keys.

    Raises:
        ConfigError: the first rule broken, naming the key, the value and the fix.
    """
    from mptrain.data.tokenizers import resolve_tokenizer

    items = node_items(data_cfg)
    target_path = items.get("_target_")
    target, _ = resolve("data", data_cfg, DATASET_PROVIDER, mapped=_data_keywords(data_cfg), drop=_schema_fields())
    accepted = accepted_keywords(target)
    if accepted is not None:
        missing = [k for k in RUNTIME_KEYWORDS if k not in accepted]
        if missing:
            raise ConfigError(f"data._target_={target_path} does not take the runtime keyword(s) {', '.join(missing)}; "
                              f"a dataset provider's __init__ must accept {', '.join(RUNTIME_KEYWORDS)} "
                              "(docs/COMPONENTS.md \"Dataset provider\")")
        for key in ("prefixes", "train_prefixes", "valid_prefixes", "test_prefixes", "corpus"):
            if items.get(key) and key not in accepted:
                raise ConfigError(f"data.{key}={items[key]} is not used by data._target_={target_path} (it takes no "
                                  f"{key!r}); remove data.{key} or pick data=indexed")
    split = items.get("split", "969,30,1")
    uses_split = (accepted is None or "split" in accepted) and not items.get("train_prefixes")
    if parse_split(split)[0] == 0 and uses_split:  # an empty train split, known before any file is read
        raise ConfigError(f"data.split={split!r} gives the train split no share; give it one, e.g. "
                          "'data.split=\"90,5,5\"'")
    # a provider that reads prefixes and was given none (data=indexed alone) is refused here, before the run folder;
    # a subclass that takes no `prefixes` keyword (its corpus comes another way, as data=shakespeare's) is not
    required = bool(getattr(target, "requires_prefixes", False)) and accepted is not None and "prefixes" in accepted
    check_corpora(items.get("prefixes"), items.get("train_prefixes"), items.get("valid_prefixes"),
                  items.get("test_prefixes"), required=required)
    resolve_tokenizer(data_cfg)


def check_corpora(prefixes: Any, train_prefixes: Any, valid_prefixes: Any, test_prefixes: Any,
                  *, required: bool = False) -> Optional[dict[str, list[tuple[float, str]]]]:
    """The corpus combination rule: `prefixes` cut by `split`, XOR separate per-split corpora.

    Args:
        required: the provider needs a corpus (indexed): neither form given is an error.
    Returns:
        {split: [(weight, prefix), ...]} for separate corpora (valid / test possibly empty lists);
        None when `prefixes` (+ split) is used, or nothing is given.
    Raises:
        ConfigError: both forms; separate corpora without train; bad blends; none given when required.
    """
    per_split = {"train": train_prefixes, "valid": valid_prefixes, "test": test_prefixes}
    given = [s for s, v in per_split.items() if v]
    if prefixes and given:
        raise ConfigError(f"data.prefixes and data.{given[0]}_prefixes exclude each other: give data.prefixes (cut by "
                          "data.split) or data.train_prefixes / valid_prefixes / test_prefixes (each corpus whole)")
    if given and not train_prefixes:
        raise ConfigError(f"data.{given[0]}_prefixes is set but data.train_prefixes is empty; set "
                          "data.train_prefixes=[PREFIX] (or use data.prefixes with data.split)")
    if given:
        return {s: parse_prefixes(v, key=f"data.{s}_prefixes") if v else [] for s, v in per_split.items()}
    if prefixes:
        parse_prefixes(prefixes)
    elif required:
        parse_prefixes(prefixes)  # raises: "data.prefixes is empty"
    return None


def parse_prefixes(prefixes: Any, *, key: str = "data.prefixes") -> list[tuple[float, str]]:
    """`[p]`, `[p1, p2]` (equal weights) or `[w1, p1, w2, p2, ...]` → [(weight, prefix), ...].

    Raises:
        ConfigError: empty, a mix that is neither form, or a weight <= 0 (names `key`).
    """
    items = list(prefixes or [])
    if not items:
        raise ConfigError(f"{key} is empty; set {key}=[PATH_PREFIX] (the --output-prefix of preprocessing)")

    def is_number(x: Any) -> bool:
        try:
            float(x)
            return not isinstance(x, bool)
        except (TypeError, ValueError):
            return False

    if not any(is_number(x) for x in items):
        return [(1.0, str(p)) for p in items]
    if len(items) % 2 or not all(is_number(w) and not is_number(p) for w, p in zip(items[::2], items[1::2])):
        raise ConfigError(f"{key}={items}: give [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    pairs = [(float(w), str(p)) for w, p in zip(items[::2], items[1::2])]
    if any(w <= 0 for w, _ in pairs):  # at start-up: the blend itself (blended.py) is built after the run folder
        raise ConfigError(f"{key}: blend weights {[w for w, _ in pairs]} must be positive; drop the prefix instead")
    return pairs


def build_provider(data_cfg: Any, **runtime: Any) -> DatasetProvider:
    """The one place a dataset provider is built: `data._target_` with `mptrain.components.build`.

    Args:
        data_cfg: the `data` node (DataConfig, DictConfig or dict with `_target_`).
        runtime: the `RUNTIME_KEYWORDS` (tokenizer, seq_length, micro_batch_size, global_batch_size,
            dp_rank, dp_size, needs_data).
    Raises:
        ConfigError / DataError: see `check_data_config` and the provider's own checks.
    """
    return build("data", data_cfg, DATASET_PROVIDER, runtime=runtime, mapped=_data_keywords(data_cfg),
                 drop=_schema_fields())


def provider_target(data_cfg: Any) -> str:
    """`data._target_` as a dotted path (for messages)."""
    target = node_items(data_cfg).get("_target_")
    return target if isinstance(target, str) else f"{import_target('data', target).__module__}.{target.__qualname__}"


def empty_split_reason(data_cfg: Any, split: str) -> str:
    """Why the provider of ``data_cfg`` has no ``split`` ("valid" | "test"), phrased by what is configured
    (the trainer logs it when evaluation skips that split); pure.

    - held-out corpora (``data.train_prefixes`` set): ``data.<split>_prefixes is empty``;
    - a provider that cuts one corpus by ``data.split`` (its signature takes ``split``):
      ``data.split=<value> leaves the <split> split empty``;
    - any other provider (a user's): ``data._target_=<path> provides no <split> split``.
    """
    items = node_items(data_cfg)
    if items.get("train_prefixes"):
        return f"data.{split}_prefixes is empty"
    target = provider_target(data_cfg)
    accepted = accepted_keywords(import_target("data", items.get("_target_")))
    if accepted is None or "split" in accepted:
        return f"data.split={items.get('split')!r} leaves the {split} split empty"
    return f"data._target_={target} provides no {split} split"


def _print_on_rank0(line: str) -> None:
    """Print a data note or warning to stderr on rank 0 only (or without a process group): rank 0 builds the
    datasets first, then every rank that reads data builds them again, and a line is said once per job."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        print(line, file=sys.stderr)


class GPTDataProvider:
    """The shipped providers' common part: per-split datasets of `sample(i) -> (tokens [s+1], valid [s+1])`,
    the Megatron sampler, collation, and the collective construction (module docstring).

    Args (runtime, see `DatasetProvider`): tokenizer, seq_length, micro_batch_size,
        global_batch_size, dp_rank, dp_size, needs_data.
    Args (data.*): seed (sample order), split (train,valid,test weights: "969,30,1" or
        [969, 30, 1]), cache_dir, reset_position_ids, reset_attention_mask, eod_mask_loss,
        create_attention_mask_in_dataloader (with reset_attention_mask: the dense [b, 1, s, s] mask too).
    Raises:
        ConfigError: inconsistent batch sizes, bad `data.*` keys (checked on every rank first).
        DataError: bad or missing data files (raised on every rank).
    """

    option = "?"
    """The conf/data option the class serves (for messages)."""

    def __init__(
        self,
        *,
        tokenizer: TokenizerProtocol,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        needs_data: bool,
        seed: int = 1234,
        split: Any = "969,30,1",
        cache_dir: Optional[str] = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        create_attention_mask_in_dataloader: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.seq_length, self.micro_batch_size, self.global_batch_size = seq_length, micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size, self.needs_data = dp_rank, dp_size, needs_data
        self.seed, self.split = int(seed), split
        self.cache_root = Path(cache_dir) if cache_dir is not None else None
        self.flags = {"reset_position_ids": bool(reset_position_ids), "reset_attention_mask": bool(reset_attention_mask),
                      "eod_mask_loss": bool(eod_mask_loss),
                      "create_attention_mask": bool(create_attention_mask_in_dataloader)}
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
        parse_split(split)
        self._check()
        self.splits = self._collective_build()

    def _check(self) -> None:
        """Subclasses: config checks (no files, no collectives), raised alike on every rank."""

    def _build_splits(self) -> dict[str, Any]:
        """Subclasses: {split: dataset or None}."""
        raise NotImplementedError

    # --- construction ------------------------------------------------------------------------
    def _collective_build(self) -> dict[str, Any]:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        splits, error, original, available = None, None, None, None
        if rank == 0:
            try:
                splits = self._build_splits()
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
        if error is not None:  # every rank raises: rank 0 alone prints (symmetric), its own error
            if original is not None:
                if isinstance(original, ConfigError):
                    original.symmetric = True
                raise original
            err = DataError(f"rank 0 could not build the data: {error}")
            err.symmetric = True
            raise err
        self.available: dict[str, bool] = available
        if splits is None and self.needs_data:
            splits = self._build_splits()
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
            if getattr(self, "per_split", None) is not None:  # held-out corpora: data.split is not used
                raise DataError(f"data.{split}_prefixes is empty (data={self.option}); set data.{split}_prefixes=[PREFIX]")
            raise DataError(
                f"data.split={self.split!r} leaves the {split} split no documents "
                f"(data={self.option}); give it a larger share, e.g. 'data.split=\"90,5,5\"'"
            )
        return self.splits.get(split)

    def _iterate(self, split: str, sampler: PretrainingSampler) -> Iterator[Optional[dict]]:
        ds = self._dataset(split) if self.needs_data else None  # None: this rank reads nothing
        eod = self.tokenizer.eod
        for indices in sampler:
            if ds is None:
                yield None
                continue
            batch = collate_arrays(*read_samples(ds, indices), eod=eod, **self.flags)
            if split == "train":
                self.samples_read += len(indices)
            else:
                self.eval_samples_read += len(indices)
            yield batch

    def train_iterator(self, consumed_samples: int) -> Iterator[Optional[dict]]:
        """This DP rank's training micro-batches from `consumed_samples` on, forever.

        Yields:
            the micro-batch dict (`DatasetProvider`), or None when `needs_data` is False.
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


class MockDataProvider(GPTDataProvider):
    """`data=mock`: `MockDataset` per split (consecutive ids mod `vocab_size` from a seeded start).

    Args:
        vocab_size: `data.vocab_size`, ids are below it (at most the tokenizer's vocab_size).
        (the rest: `GPTDataProvider`)
    Raises:
        ConfigError: vocab_size above the tokenizer's.
    """

    option = "mock"

    # explicit keywords (no **kwargs): the start-up check offers a data.* key only to a class that names it
    def __init__(self, *, vocab_size: int = 1000, tokenizer: TokenizerProtocol, seq_length: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, needs_data: bool, seed: int = 1234, split: Any = "969,30,1",
                 cache_dir: Optional[str] = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, create_attention_mask_in_dataloader: bool = False) -> None:
        self.vocab_size = int(vocab_size)
        super().__init__(tokenizer=tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size, needs_data=needs_data,
                         seed=seed, split=split, cache_dir=cache_dir, reset_position_ids=reset_position_ids,
                         reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                         create_attention_mask_in_dataloader=create_attention_mask_in_dataloader)

    def _check(self) -> None:
        if self.vocab_size > self.tokenizer.vocab_size:
            # raising the tokenizer's size is a fix only where its vocab_size is a key (NullTokenizer's, not a file's)
            sized = "vocab_size" in (accepted_keywords(type(self.tokenizer)) or ())
            raise ConfigError(
                f"data.vocab_size={self.vocab_size} exceeds the tokenizer's vocab_size={self.tokenizer.vocab_size}; "
                f"set data.vocab_size<={self.tokenizer.vocab_size}"
                + (" or raise data.tokenizer.vocab_size" if sized else "")
            )

    def _build_splits(self) -> dict[str, Any]:
        # a split data.split gives no weight has no data (Megatron's mock datasets: its evaluation is skipped);
        # the others are unbounded, so their weights size nothing
        weights = dict(zip(SPLITS, parse_split(self.split)))
        return {s: MockDataset(vocab_size=self.vocab_size, seq_length=self.seq_length, seed=self.seed, split=s)
                if weights[s] > 0 else None for s in SPLITS}


class IndexedDataProvider(GPTDataProvider):
    """`data=indexed`: preprocessed `.bin/.idx` datasets (blends allowed).

    Args:
        prefixes: one corpus cut into train/valid/test by documents with `split`.
        train_prefixes, valid_prefixes, test_prefixes: separate corpora, each used whole (train
            shuffled per epoch, valid / test in file order); an empty valid / test list means no
            such evaluation. Exclusive with `prefixes` (`check_corpora`).
        (the rest: `GPTDataProvider`)
    Raises:
        ConfigError: see `check_corpora`; the data was preprocessed with another tokenizer
            (`check_tokenizer_record`).
        DataError: missing / truncated files, empty corpora, token ids above the tokenizer's.
    """

    option = "indexed"
    requires_prefixes = True  # `check_data_config`: no corpus given is a config error, found at validation

    def __init__(self, *, prefixes: Sequence = (), train_prefixes: Sequence = (), valid_prefixes: Sequence = (),
                 test_prefixes: Sequence = (), tokenizer: TokenizerProtocol, seq_length: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, needs_data: bool, seed: int = 1234, split: Any = "969,30,1",
                 cache_dir: Optional[str] = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, create_attention_mask_in_dataloader: bool = False) -> None:
        self.prefixes = list(prefixes or [])
        self.per_split = check_corpora(self.prefixes, list(train_prefixes or []), list(valid_prefixes or []),
                                       list(test_prefixes or []), required=self.requires_prefixes)
        super().__init__(tokenizer=tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size, needs_data=needs_data,
                         seed=seed, split=split, cache_dir=cache_dir, reset_position_ids=reset_position_ids,
                         reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                         create_attention_mask_in_dataloader=create_attention_mask_in_dataloader)

    def _build_splits(self) -> dict[str, Any]:
        self._unrecorded: list[str] = []  # prefixes without a tokenizer record (Megatron's data): said in one line
        splits = self._datasets()
        if self._unrecorded:
            _print_on_rank0(unrecorded_note(self._unrecorded))
        return splits

    def _datasets(self) -> dict[str, Any]:
        """{split: dataset or None} of the configured prefixes (`_open` each)."""
        if self.per_split is not None:
            return {s: self._blend([(w, self._open(p), None) for w, p in self.per_split[s]], s) for s in SPLITS}
        return self._cut(parse_prefixes(self.prefixes))

    def _open(self, prefix: str) -> IndexedDataset:
        """The indexed dataset of `prefix`, checked against the configured tokenizer."""
        indexed = IndexedDataset(prefix)
        if indexed.num_documents == 0:
            raise DataError(f"{prefix}.idx: no documents; re-run preprocessing on a non-empty corpus")
        if not check_tokenizer_record(prefix, self.tokenizer) and prefix not in self._unrecorded:
            self._unrecorded.append(prefix)
        # Ids the tokenizer cannot produce mean the data was made with another tokenizer: the
        # embedding would index out of range (tp 1) or silently mask them (tp > 1).
        max_id = indexed.max_token_id()
        if max_id >= self.tokenizer.vocab_size:
            raise DataError(
                f"{prefix}.bin holds token id {max_id} but data.tokenizer has {self.tokenizer.vocab_size} ids: the data "
                f"was preprocessed with another tokenizer; set data.tokenizer to that one, e.g. "
                f"data.tokenizer._target_=mptrain.data.tokenizers.HFTokenizer +data.tokenizer.tokenizer_json=PATH"
            )
        return indexed

    def _cut(self, weighted: list[tuple[float, str]], index_cache: Optional[Path] = None) -> dict[str, Any]:
        """`data.split` over each prefix's documents, blended per split."""
        per_split: dict[str, list] = {s: [] for s in SPLITS}
        for weight, prefix in weighted:
            indexed = self._open(prefix)
            for s, doc_range in split_document_ranges(self.split, indexed.num_documents).items():
                if doc_range[1] > doc_range[0]:
                    per_split[s].append((weight, indexed, doc_range))
        single = len(weighted) == 1
        return {s: self._blend(items, s, index_cache=index_cache, single=single) for s, items in per_split.items()}

    def _blend(self, items: list, split: str, *, index_cache: Optional[Path] = None, single: Optional[bool] = None) -> Any:
        """One GPTDataset per (weight, indexed, doc range or None = all); a blend when there are several."""
        if not items:
            return None
        datasets = [
            GPTDataset(indexed, doc_range=doc_range or (0, indexed.num_documents), seq_length=self.seq_length,
                       seed=self.seed, split=split, shuffle=(split == "train"), eod=self.tokenizer.eod,
                       cache_dir=index_cache or self._index_cache(str(indexed.prefix)))
            for _, indexed, doc_range in items
        ]
        for d in datasets:
            if d.num_tokens < d.seq_length + 1:
                _print_on_rank0(f"warning: data: the {split} split of {d.indexed.prefix} has {d.num_tokens} tokens, fewer "
                               f"than one sample (model.seq_length + 1 = {d.seq_length + 1}): its one sample is mostly "
                               "padding; lower model.seq_length, or give the split more documents (data.split)")
        if (single if single is not None else len(items) == 1):
            return datasets[0]
        return BlendedDataset(datasets, [w for w, _, _ in items])


class ShakespeareDataProvider(IndexedDataProvider):
    """`data=shakespeare`: the shipped corpus (or `corpus`), preprocessed on first use with the
    configured tokenizer into `<cache_dir or mptrain.resources.default_cache_dir()>/<name>-<fingerprint>-<size>.bin/.idx`,
    then cut by `split` as `data=indexed`.

    Args:
        corpus: a JSONL(.gz) path; None = the shipped shakespeare.jsonl.gz (`mptrain.resources.shipped_corpus`).
        (the rest: `GPTDataProvider`)
    """

    option = "shakespeare"

    def __init__(self, *, corpus: Optional[str] = None, tokenizer: TokenizerProtocol, seq_length: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, needs_data: bool, seed: int = 1234, split: Any = "969,30,1",
                 cache_dir: Optional[str] = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 eod_mask_loss: bool = False, create_attention_mask_in_dataloader: bool = False) -> None:
        self.corpus = Path(corpus) if corpus else shipped_corpus()
        self.prefixes, self.per_split = [], None
        GPTDataProvider.__init__(self, tokenizer=tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size, needs_data=needs_data,
                         seed=seed, split=split, cache_dir=cache_dir, reset_position_ids=reset_position_ids,
                         reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                         create_attention_mask_in_dataloader=create_attention_mask_in_dataloader)

    def _datasets(self) -> dict[str, Any]:
        from mptrain.data.preprocess import preprocess

        corpus = self.corpus
        if not corpus.is_file():
            raise DataError(f"{corpus}: the Shakespeare corpus is missing; set data.corpus=PATH/shakespeare.jsonl(.gz)")
        root = self.cache_root if self.cache_root is not None else default_cache_dir()
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", self.tokenizer.fingerprint)
        prefix = root / f"{corpus.name.split('.')[0]}-{tag}-{corpus.stat().st_size}"
        if recorded_eod(str(prefix)) not in (None, self.tokenizer.eod):  # the same file with another eod_token
            prefix = root / f"{corpus.name.split('.')[0]}-{tag}-eod{self.tokenizer.eod}-{corpus.stat().st_size}"
        if not Path(f"{prefix}.idx").is_file():
            print(f"data: preprocessing {corpus} into {prefix}.bin/.idx (first use)", file=sys.stderr)
            preprocess([str(corpus)], output_prefix=str(prefix), tokenizer=self.tokenizer, workers=1, overwrite=True,
                       progress=False)
        return self._cut([(1.0, str(prefix))], index_cache=root / "index")
