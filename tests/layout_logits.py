"""Logits of an imported checkpoint at tp2pp1 and tp1pp2 (and ep2 for an MoE model) on a 2-rank pool, each layout
loaded (resharded) by training's own load: the check that an import (Hugging Face, Megatron) is layout-independent."""

import torch

LAYOUTS = {"tp2pp1": {"tensor_model_parallel_size": 2}, "tp1pp2": {"pipeline_model_parallel_size": 2}}
"""{name: `mptrain.config.parallel.ParallelConfig` keys} of a dense model's layouts."""
MOE_LAYOUTS = {"tp2pp1": {"tensor_model_parallel_size": 2, "sequence_parallel": True},  # MoE at tp > 1 needs SP
               "tp1pp2": {"pipeline_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2}}
"""An MoE model's layouts: experts split over TP (ETP = TP), over the pipeline stages, over EP (2 experts' halves)."""


def layout_logits(ckpt: str, ids: torch.Tensor, layouts: dict = LAYOUTS) -> dict:
    """{layout name: logits [b, s, V] (every rank; at pp2 on the last stage, None on rank 0)} of the checkpoint
    ``ckpt`` for token ids ``ids`` [b, s] at each of ``layouts`` (`LAYOUTS`, `MOE_LAYOUTS`); call on both ranks of a
    world-2 pool task."""
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
    for name, keys in layouts.items():
        parallel = ParallelConfig(**keys)
        pp = parallel.pipeline_model_parallel_size
        groups = build_groups(parallel.tensor_model_parallel_size, pp, None, device=torch.device("cpu"),
                              expert_model_parallel_size=parallel.expert_model_parallel_size)
        try:
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
            out[name] = logits
        finally:
            groups.destroy()
    return out
