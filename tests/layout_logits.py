"""Logits of an imported checkpoint at tp2pp1 and tp1pp2 on a 2-rank pool, each layout loaded (resharded) by
training's own load: the check that an import (Hugging Face, Megatron) is layout-independent."""

import torch


def layout_logits(ckpt: str, ids: torch.Tensor) -> dict:
    """{"tp2pp1": logits [b, s, V] (every rank), "tp1pp2": logits on the last stage (None on rank 0)} of the
    checkpoint ``ckpt`` for token ids ``ids`` [b, s]; call on both ranks of a world-2 pool task."""
    import torch.distributed as dist

    from mptrain.checkpoint import atomic
    from mptrain.checkpoint.api import atomic_meta, load_model_weights
    from mptrain.checkpoint.offline import model_config_from_dict
    from mptrain.config.parallel import ParallelConfig
    from mptrain.groups import build_groups
    from mptrain.inference import gather_vocab
    from mptrain.layers.gpt import build_model_chunks

    folder, _ = atomic.resolve_load_dir(ckpt)
    meta = atomic_meta(folder)
    saved, vocab = meta["config"], int(meta["vocab_size"])
    s, b = ids.shape[1], ids.shape[0]
    pos, out = torch.arange(s).expand(b, s), {}
    for tp, pp in ((2, 1), (1, 2)):
        groups = build_groups(tp, pp, None, device=torch.device("cpu"))
        try:
            parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            chunks = build_model_chunks(model_config_from_dict(saved["model"]), parallel, groups, vocab_size=vocab)
            load_model_weights(folder, chunks, groups, saved)
            model = chunks[0].eval()
            with torch.no_grad():
                if pp == 1:
                    logits = gather_vocab(model(ids, pos), groups, vocab)
                elif groups.pp_rank == 0:
                    dist.send(model(ids, pos).contiguous(), groups.next_pp_rank)  # hidden [s, b, h]
                    logits = None
                else:
                    hidden = torch.empty(s, b, saved["model"]["hidden_size"])
                    dist.recv(hidden, groups.prev_pp_rank)
                    model.set_input_tensor(hidden)
                    logits = gather_vocab(model(None, pos), groups, vocab)
            out[f"tp{tp}pp{pp}"] = logits
        finally:
            groups.destroy()
    return out
