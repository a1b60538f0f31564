"""Generate text from a checkpoint (nanoGPT's ``sample.py``, Megatron's text generation).

    python -m mptrain.generate --checkpoint DIR --prompt TEXT --max-new-tokens N \\
        [--temperature T --top-k K --top-p P --seed S] [--prompt-file F] [--iteration N] [--json]
    torchrun --nproc_per_node=2 -m mptrain.generate --checkpoint DIR ...       # tp 2 (the world size)

Greedy at ``--temperature 0`` (the default); the text goes to stdout (rank 0): the prompt followed
by the completion, or with ``--json`` one object ``{"prompt_ids", "new_ids", "text",
"completion"}``. Generation stops after ``--max-new-tokens`` tokens or at the tokenizer's EOD
(not printed). The prompt is encoded as training data was: with the BOS first when the tokenizer's family
adds one (Llama: `mptrain.data.tokenizers.bos_token_id`), as ``transformers``' ``tok(prompt)`` does; an
empty prompt is that BOS alone, else EOD (the document boundary the model was trained on).
A checkpoint trained on ``data=mock`` (NullTokenizer) reads the prompt as space-separated token ids.

What is loaded, from the checkpoint alone: the model config and tokenizer from its saved config
(``config.yaml`` content in ``meta.json``: ``model.*``, ``data.tokenizer``), the weights resharded
to this run's layout by the checkpoint module (fp32 master weights when the run kept them), built
by the trainer's own `build_model_chunks` (a relative ``data.tokenizer.tokenizer_json`` is read
relative to the current folder, as training read it). Layout: tensor parallelism over
``--tensor-model-parallel-size`` ranks (default: the world size), pipeline parallelism 1 (one
prompt decodes token by token, so pipeline stages would only wait on each other) and no data
parallelism: the world size must equal the TP size; an MoE model decodes with its experts whole on every TP
rank (`decoding_layout`). Decoding uses a KV cache
(`mptrain.inference`), and falls back to recomputing the prefix for layer classes it does not know.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from mptrain.data.tokenizers import NullTokenizer
from mptrain.errors import ConfigError, launch_rank_and_world, report_and_exit


@dataclasses.dataclass
class Generator:
    """A loaded model ready to decode: this rank's chunk, its groups, the tokenizer, the vocab size."""

    model: torch.nn.Module
    groups: object
    tokenizer: object
    vocab_size: int
    max_positions: int
    iteration: int
    prompt_ids: Optional[list] = None
    """`load_generator`'s ``prompt`` encoded (None when no prompt was given)."""


def _saved_model_config(saved: dict, tp: int):
    """ModelConfig from the checkpoint's saved ``model`` dict, with training-only switches off."""
    from mptrain.checkpoint.offline import model_config_from_dict

    model = model_config_from_dict(saved["model"])
    # torch.compile and recomputation change no math and would only slow a one-token step down
    return dataclasses.replace(model, compile_layers=False, recompute_granularity=None, recompute_activations=False)


def encode_prompt(tokenizer, text: str, saved: dict, vocab_size: int) -> list:
    """``text`` as token ids of the checkpoint's tokenizer, each in [0, ``vocab_size``).

    Raises:
        ConfigError: the tokenizer cannot read ``text`` (a NullTokenizer, the one of ``data=mock``, reads
            space-separated ids only), or an id is out of the vocabulary (one line naming the fix).
    """
    target = str(((saved.get("data") or {}).get("tokenizer") or {}).get("_target_", type(tokenizer).__name__))
    try:
        ids = tokenizer.encode(text)
    except ValueError as err:
        if isinstance(tokenizer, NullTokenizer):
            raise ConfigError(f"--prompt {text[:40]!r}: the checkpoint's data.tokenizer is NullTokenizer (no text: "
                              "trained on data=mock), which reads token ids only; pass ids such as --prompt '1 2 3', or "
                              "train with a text tokenizer (data.tokenizer, e.g. data=shakespeare's "
                              "ByteTokenizer)") from None
        raise ConfigError(f"--prompt: data.tokenizer {target} cannot encode it ({str(err).splitlines()[0]})") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"--prompt: token ids {bad[:4]} are outside the vocabulary [0, {vocab_size}); pass ids "
                          f"below {vocab_size}")
    return ids


def decoding_layout(model_cfg, tp: int) -> tuple:
    """``(checked, built, etp)``: the `ParallelConfig` whose rules the model is checked against, the one it is built
    with, and the expert-tensor-parallel size, for decoding at ``tp``.

    Dense models: tensor parallelism alone. MoE models: decoding feeds one token at a time, so there is no sequence
    to split over TP and the model is built without sequence parallelism, every TP rank holding every expert whole
    (``expert_tensor_parallel_size=1``, resharded from the checkpoint's layout) and routing every token itself (the
    same routing on every rank: their activations are the same after each row-parallel all-reduce). The rules are
    checked as training at ``tp`` checks them, with sequence parallelism on (`mptrain.layers.moe.config`).
    """
    from mptrain.config.parallel import ParallelConfig

    if getattr(model_cfg, "num_moe_experts", None) is None:
        plain = ParallelConfig(tensor_model_parallel_size=tp)
        return plain, plain, None
    checked = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_tensor_parallel_size=1)
    return checked, ParallelConfig(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1), 1


def load_generator(checkpoint: str, *, iteration: Optional[int] = None, tensor_model_parallel_size: Optional[int] = None,
                   timeout_s: float = 600.0, prompt: Optional[str] = None) -> Generator:
    """Initialise distributed (a world of one without torchrun), build the model, load the weights.

    ``prompt`` (text) is encoded (`encode_prompt`) before any process group exists, into
    ``Generator.prompt_ids``. Collective on every rank. Raises:
        ConfigError: no checkpoint there, a file that does not match its manifest.json
            (`mptrain.checkpoint.offline.checkpoint_folder`), world size ≠ TP size, the model does not fit the layout,
            the saved tokenizer cannot be built, or it cannot encode ``prompt``.
    """
    from mptrain.checkpoint.api import load_model_weights
    from mptrain.data.tokenizers import build_tokenizer
    from mptrain.checkpoint.offline import atomic_meta, checkpoint_folder
    from mptrain.groups import build_groups, init_distributed, read_dist_env
    from mptrain.layers.gpt import build_model_chunks, check_model_config

    try:  # every rank checks every file against manifest.json, before any process group exists
        folder = checkpoint_folder(checkpoint, iteration)
    except FileNotFoundError as err:
        raise ConfigError(f"--checkpoint: {err}") from None
    meta = atomic_meta(folder)
    saved = meta.get("config", {})
    env = read_dist_env()
    tp = tensor_model_parallel_size or env.world_size
    if env.world_size != tp:
        raise ConfigError(f"--tensor-model-parallel-size={tp} with world size {env.world_size}: generation runs one "
                          f"model replica with pipeline size 1; launch with --nproc_per_node={tp}")
    model_cfg = _saved_model_config(saved, tp)
    check_parallel, parallel, etp = decoding_layout(model_cfg, tp)
    try:  # heads / groups vs tp, before any collective; the fix is the process count, not a config key
        check_model_config(model_cfg, check_parallel)
    except ConfigError as err:
        raise ConfigError(f"--tensor-model-parallel-size={tp}: the checkpoint's model does not split over {tp} ranks "
                          f"({str(err).split(';')[0]}); launch with a --nproc_per_node that divides it") from None
    tokenizer = build_tokenizer(saved.get("data", {}))
    prompt_ids = None if prompt is None else encode_prompt(tokenizer, prompt, saved, int(meta["vocab_size"]))
    device = init_distributed(env, timeout_s=timeout_s)
    groups = build_groups(tp, 1, None, expert_tensor_parallel_size=etp, device=device)
    try:
        model = build_model_chunks(model_cfg, parallel, groups,
                                   vocab_size=int(meta["vocab_size"]), seed=int(saved.get("train", {}).get("seed", 1234)),
                                   params_dtype=torch.float32, device=device)[0]
        load_model_weights(folder, [model], groups, saved)
    except BaseException:
        groups.destroy()
        raise
    model.eval()
    max_positions = model_cfg.max_position_embeddings or model_cfg.seq_length
    return Generator(model, groups, tokenizer, int(meta["vocab_size"]), int(max_positions), int(meta["iteration"]),
                     prompt_ids)


@torch.no_grad()
def generate_ids(gen: Generator, prompt_ids: list, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 1234, use_cache: bool = True) -> list:
    """The new token ids (EOD excluded) after ``prompt_ids`` (collective over the TP group).

    Raises:
        ConfigError: prompt + max_new_tokens exceed the model's positions, or a bad sampling value.
    """
    from mptrain.inference import KVCache, cached_forward, gather_vocab, sample_next, supports_kv_cache

    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise ConfigError(f"--temperature={temperature} (>= 0), --top-p={top_p} (in (0, 1]), --top-k={top_k} (>= 0), "
                          f"--max-new-tokens={max_new_tokens} (>= 0): fix the out-of-range value")
    prompt = list(prompt_ids) or [gen.tokenizer.eod]
    total = len(prompt) + max_new_tokens
    if total > gen.max_positions:
        raise ConfigError(f"--max-new-tokens={max_new_tokens} + prompt length {len(prompt)} = {total} exceeds the "
                          f"model's {gen.max_positions} positions (model.max_position_embeddings / seq_length); lower "
                          "--max-new-tokens or shorten the prompt")
    model, groups = gen.model, gen.groups
    device = next(model.parameters()).device
    rng = torch.Generator().manual_seed(int(seed))
    cached = use_cache and supports_kv_cache(model)
    cache = KVCache.empty(model, batch_size=1, max_len=total) if cached else None
    seq = torch.tensor([prompt], dtype=torch.int64, device=device)  # [1, s]
    new: list = []
    step_in, start = seq, 0
    for _ in range(max_new_tokens):
        if cached:
            logits = cached_forward(model, step_in, start, cache)[:, -1]  # [1, V_pad/tp]
            start = cache.length
        else:
            positions = torch.arange(seq.shape[1], device=device).unsqueeze(0)
            logits = model(seq, positions)[:, -1]
        token = sample_next(gather_vocab(logits, groups, gen.vocab_size), temperature=temperature, top_k=top_k,
                            top_p=top_p, generator=rng)  # [1]
        if groups.tp_size > 1:  # every rank drew the same token from the same logits; make it certain
            dist.broadcast(token, src=groups.tp_src_rank, group=groups.tp_group)
        t = int(token.item())
        if t == gen.tokenizer.eod:
            break
        new.append(t)
        step_in = token.view(1, 1)
        seq = torch.cat([seq, step_in], dim=1)
    return new


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint.save folder (uses `latest`) or an iter_N folder")
    parser.add_argument("--iteration", type=int, default=None, help="which iteration (default: latest)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="the prompt text")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from this file (UTF-8, as is)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the top tokens of mass p (1 = all)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (default: 1234)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=None, help="default: the world size")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix per token (for checks)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with ids and text")
    args = parser.parse_args(argv)
    gen = None
    try:
        text = Path(args.prompt_file).read_text(encoding="utf-8") if args.prompt_file else (args.prompt or "")
        gen = load_generator(args.checkpoint, iteration=args.iteration,
                             tensor_model_parallel_size=args.tensor_model_parallel_size, prompt=text)
        prompt_ids = gen.prompt_ids
        new = generate_ids(gen, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=not args.no_kv_cache)
        if gen.groups.rank == 0:
            completion = gen.tokenizer.decode(new)
            # ids (a NullTokenizer reads and writes "1 2 3"): decoded as one sequence, so the prompt's last id
            # and the first new one stay apart; text: the prompt as given, then the completion
            full = gen.tokenizer.decode(prompt_ids + new) if isinstance(gen.tokenizer, NullTokenizer) else text + completion
            if args.json:
                print(json.dumps({"prompt_ids": prompt_ids, "new_ids": new, "text": full, "completion": completion}))
            else:
                print(full)
        return 0
    except (ConfigError, OSError) as err:
        try:
            rank, world_size = launch_rank_and_world()
        except ValueError:
            rank, world_size = 0, 1
        if world_size > 1:
            # before the process group the error comes from the arguments and the checkpoint's files: alike on
            # every rank, rank 0 says it and the others wait for it (`report_and_exit`); after it, each its own
            report_and_exit(f"error: {err}", rank=rank, world_size=world_size, symmetric=not dist.is_initialized())
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if gen is not None:
            gen.groups.destroy()
        if dist.is_initialized() and __name__ == "__main__":
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
