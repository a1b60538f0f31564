"""The GPT model chunk, the pipeline layer split, and model construction (ARCHITECTURE.md "Model chunk").

Legend: token tensors ``[b, s]``; activations ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
parallelism); ``V`` unpadded vocabulary, ``V_pad`` padded to ``make_vocab_size_divisible_by × tp``.

A chunk is: [embedding (first stage)] -> its layers (global indices) -> [final norm + output
layer (last stage)]. Parameter names are global (``embedding.word_embeddings.weight``,
``decoder.layers.<n>.…``, ``decoder.final_layernorm.…``, ``output_layer.weight``) and each
parameter's initial value depends only on (seed, name), so the full model is the same in every
TP/PP/VPP layout. The output layer reuses the word embedding unless
``untie_embeddings_and_output_weights``; with pp > 1 the last stage holds a copy
(``output_layer.weight``, spec ``is_shared_copy``) that `build_model_chunks` syncs from the first
stage (zeros + all-reduce over ``groups.embedding_group``,
megatron/core/models/common/language_module/language_module.py); keeping the two
equal afterwards (all-reduce of their grads) is ``finalize_model_grads``' job.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from mptrain.components import ComponentKind, build
from mptrain.config.model import ModelConfig
from mptrain.errors import ConfigError, check_choice
from mptrain.layers.attention import check_attention_backend, rotary_dim
from mptrain.layers.compile import CompilePlan, apply_compile, check_compile, compile_mode_for, plan_compile
from mptrain.layers.context import LayerContext, layer_context
from mptrain.layers.cross_entropy import vocab_parallel_cross_entropy
from mptrain.layers.cp_blocks import document_plan
from mptrain.layers.document_mask import DocumentMask, document_backend
from mptrain.layers.embedding import GPTEmbedding, padded_vocab_size, vocab_range, vocab_shard_spec
from mptrain.layers.grad_accumulation_fusion import MainGradOf
from mptrain.layers.linear import column_parallel_linear
from mptrain.layers.mlp import check_activation
from mptrain.layers.moe.config import check_moe_config
from mptrain.layers.norms import check_normalization
from mptrain.layers.random import ParamInit, RNGStatesTracker, init_rng_tracker
from mptrain.layers.sharding import take_shard
from mptrain.layers.transformer import TransformerBlock, check_recompute, check_spec_tree

def check_rotary_percent(model, head_dim: int) -> None:
    """``model.rotary_percent``: in (0, 1], with RoPE only, rotating an even number >= 2 of each head's dims.

    Raises:
        ConfigError: one line naming the key, the value and the fix.
    """
    p = model.rotary_percent
    if not 0.0 < p <= 1.0:
        raise ConfigError(f"model.rotary_percent={p} must be in (0, 1] (the share of each head's dims RoPE rotates)")
    if p < 1.0 and model.position_embedding_type != "rope":
        raise ConfigError(f"model.rotary_percent={p} applies to RoPE only, but model.position_embedding_type="
                          f"{model.position_embedding_type}; set model.position_embedding_type=rope or "
                          "model.rotary_percent=1.0")
    rot = rotary_dim(head_dim, p)
    if rot < 2 or rot % 2:
        raise ConfigError(f"model.rotary_percent={p} rotates int({p} × head dim {head_dim}) = {rot} dims, which must be "
                          "even and >= 2; pick a rotary_percent that gives an even width")


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
"""``model.position_embedding_type``: learned absolute (the embedding) or rotary (`attention.apply_rope`)."""


# --- validation ---------------------------------------------------------------------------------
def _positive(key: str, value: Optional[int], *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be an integer >= 1{' or null' if allow_none else ''}")


def check_model_config(model, parallel) -> None:
    """Every model × layout rule (DESIGN.md §5), once; pure (config only), run by
    `mptrain.training.validate.validate_config` on every rank before any process group exists.

    Order: sizes, heads vs tp / hidden / query groups, ffn vs tp, the closed Megatron choices
    (normalization, activation, attention_backend, position_embedding_type, recompute_*), position
    embeddings vs seq_length, dropout, sequence parallelism vs seq_length, the layer split over pp × vpp, the
    Mixture-of-Experts keys (`mptrain.layers.moe.config.check_moe_config`).

    Raises:
        ConfigError: one line naming the keys, the values and the fix.
    """
    tp = parallel.tensor_model_parallel_size
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _positive(f"model.{key}", getattr(model, key))
    heads, h = model.num_attention_heads, model.hidden_size
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tensor_model_parallel_size="
                          f"{tp}; pick a parallel= with tp dividing {heads}, or another model=")
    if model.kv_channels is None and h % heads:
        raise ConfigError(f"model.hidden_size={h} is not divisible by model.num_attention_heads={heads}; change one "
                          "of them or set model.kv_channels")
    groups = model.num_query_groups
    if groups is not None:
        _positive("model.num_query_groups", groups)
        if heads % groups:
            raise ConfigError(f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}; "
                              f"set model.num_query_groups to a divisor of {heads} (or null for multi-head attention)")
        if groups % tp:
            raise ConfigError(f"model.num_query_groups={groups} is not divisible by parallel.tensor_model_parallel_size="
                              f"{tp}; K/V heads are split over TP: use a smaller tp or more query groups")
    ffn = model.ffn_hidden_size or 4 * h
    if ffn % tp:
        raise ConfigError(f"model.ffn_hidden_size={ffn} is not divisible by parallel.tensor_model_parallel_size={tp}; "
                          "change ffn_hidden_size or the TP size")
    check_normalization(model)
    check_activation(model)
    check_attention_backend(model)
    check_choice("model.position_embedding_type", model.position_embedding_type, POSITION_EMBEDDING_TYPES)
    check_compile(model)
    check_recompute(model)
    hn = model.kv_channels or h // heads
    if model.position_embedding_type == "rope" and hn % 2:
        raise ConfigError(f"model.position_embedding_type=rope needs an even head dim (kv_channels={hn}); change "
                          "kv_channels or hidden_size / num_attention_heads")
    check_rotary_percent(model, hn)
    if model.position_embedding_type == "learned_absolute" and model.max_position_embeddings is not None:
        if model.seq_length > model.max_position_embeddings:
            raise ConfigError(f"model.seq_length={model.seq_length} exceeds model.max_position_embeddings="
                              f"{model.max_position_embeddings}; raise max_position_embeddings or set it to null")
    for key in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(model, key) < 1.0:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be in [0, 1)")
    if parallel.sequence_parallel and tp > 1 and model.seq_length % tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over tp: model.seq_length={model.seq_length} is "
            f"not divisible by tensor_model_parallel_size={tp}; change seq_length or set parallel.sequence_parallel=false")
    check_layer_split(model.num_layers, parallel.pipeline_model_parallel_size,
                      parallel.virtual_pipeline_model_parallel_size, parallel.decoder_first_pipeline_num_layers,
                      parallel.decoder_last_pipeline_num_layers)
    check_moe_config(model, parallel)


def check_model_components(model) -> None:
    """Start-up check of the model provider (``model._target_``) and the layer spec tree; pure.

    Raises:
        ConfigError: a target that does not import, lacks a method of its interface, or gets a
            keyword it does not take (naming the config key).
    """
    from mptrain.components import resolve

    resolve("model", model, MODEL_KIND, drop=MODEL_FIELDS)
    check_spec_tree(model)


# --- pipeline split -----------------------------------------------------------------------------
def check_layer_split(num_layers: int, pp: int, vpp: Optional[int] = None,
                      decoder_first_pipeline_num_layers: Optional[int] = None,
                      decoder_last_pipeline_num_layers: Optional[int] = None) -> None:
    """num_layers over pp × vpp stages: even unless decoder_first/last_pipeline_num_layers are set.

    Uneven split (Megatron-core's num_layers_in_first/last_pipeline_stage): the first and/or last
    stage hold the given counts; the other pp − k stages share the rest evenly. With vpp, every
    stage's count must split into vpp chunks.

    Raises:
        ConfigError: num_layers not divisible by pp × vpp (even split), or an uneven split that
            does not add up (naming the keys and the numbers).
    """
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    chunks = vpp or 1
    if first is None and last is None:
        if num_layers % (pp * chunks) != 0:
            vpp_txt = f" × virtual_pipeline_model_parallel_size = {pp} × {chunks} = {pp * chunks}" if vpp else f" = {pp}"
            raise ConfigError(
                f"model.num_layers={num_layers} is not divisible by pipeline_model_parallel_size{vpp_txt}; "
                f"pick another parallel= or model=, or set parallel.decoder_first_pipeline_num_layers / "
                f"decoder_last_pipeline_num_layers for an uneven split")
        return
    if pp == 1:
        raise ConfigError("parallel.decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers need "
                          "pipeline_model_parallel_size > 1 (got 1); set them to null")
    fixed = {k: v for k, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last))
             if v is not None}
    for key, value in fixed.items():
        _positive(f"parallel.{key}", value)
        if value % chunks != 0:
            raise ConfigError(f"parallel.{key}={value} is not divisible by virtual_pipeline_model_parallel_size="
                              f"{chunks}; give that stage a multiple of {chunks} layers")
    rest = num_layers - sum(fixed.values())
    middle = pp - len(fixed)
    given = " + ".join(f"{k}={v}" for k, v in fixed.items())
    if middle == 0:
        if rest != 0:
            raise ConfigError(f"parallel: {given} must add up to model.num_layers={num_layers} with "
                              f"pipeline_model_parallel_size={pp}; change them")
        return
    if rest < middle * chunks or rest % (middle * chunks) != 0:
        raise ConfigError(
            f"parallel: with {given}, the other {middle} pipeline stage(s) get {rest} of model.num_layers={num_layers} "
            f"layers, not a positive multiple of {middle}{f' × vpp {chunks}' if vpp else ''}; change the uneven split")


def pipeline_layer_ranges(num_layers: int, pp: int, vpp: Optional[int] = None,
                          decoder_first_pipeline_num_layers: Optional[int] = None,
                          decoder_last_pipeline_num_layers: Optional[int] = None) -> list:
    """Global layer indices per pp rank and virtual chunk: ``result[pp_rank][chunk] = [indices]``.

    Megatron's interleaved assignment: the layers are cut into pp × vpp consecutive blocks in the
    order (chunk 0: ranks 0..pp-1), (chunk 1: ranks 0..pp-1), ...; chunk c of rank r holds block
    c·pp + r. Example: 8 layers, pp 2, vpp 2 -> rank 0: [[0, 1], [4, 5]], rank 1: [[2, 3], [6, 7]].
    Uneven split (only when asked for): the first / last stage hold the given number of layers
    (split evenly over their vpp chunks), the other stages share the rest evenly.

    Raises:
        ConfigError: see `check_layer_split`.
    """
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    check_layer_split(num_layers, pp, vpp, first, last)
    vpp = vpp or 1
    per_stage = [None] * pp  # layers per stage, all chunks together
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    middle = sum(n is None for n in per_stage)
    rest = num_layers - sum(n for n in per_stage if n is not None)
    per_chunk = [(n if n is not None else rest // middle) // vpp for n in per_stage]
    out = [[None] * vpp for _ in range(pp)]
    start = 0
    for c in range(vpp):
        for r in range(pp):
            out[r][c] = list(range(start, start + per_chunk[r]))
            start += per_chunk[r]
    return out


# --- the model chunk ----------------------------------------------------------------------------
class OutputLayer(torch.nn.Module):
    """Logits ``[s, b, V_pad/tp]`` = X Wᵀ with W the vocab-parallel ``[V_pad/tp, h]`` weight (column-parallel).

    Holds its own ``weight`` when untied, or as the last stage's copy of a tied embedding
    (pp > 1); otherwise (tied, same chunk as the embedding) the caller passes the embedding weight.
    ``weight_main_grad``: the used weight's ``main_grad`` view under gradient accumulation fusion
    (set by the DDP wrapper through `GPTModel.output_weight`), else None.

    Args:
        config: ModelConfig. context: `LayerContext` (groups, sequence_parallel, init, params_dtype,
            device, async_tensor_model_parallel_allreduce). vocab_size: V (unpadded).
        own_weight: ``untied`` (its own weight), ``shared_copy`` (the last stage's zero copy of the
            tied embedding) or ``none`` (the caller passes the embedding weight).
    """

    def __init__(self, config, context: LayerContext, *, vocab_size: int, own_weight: str) -> None:
        super().__init__()
        groups = context.groups
        self.groups, self.sequence_parallel = groups, context.sequence_parallel
        self.async_grad_allreduce = context.async_tensor_model_parallel_allreduce
        h = config.hidden_size
        v_pad = padded_vocab_size(vocab_size, config.make_vocab_size_divisible_by, groups.tp_size)
        start, end = vocab_range(v_pad, groups.tp_rank, groups.tp_size)
        self._spec = None
        self.weight_main_grad: Optional[torch.Tensor] = None
        if own_weight == "none":
            self.register_parameter("weight", None)
            return
        shared = own_weight == "shared_copy"
        self._spec = vocab_shard_spec(vocab_size, h, v_pad, groups, tied_embedding=shared, is_shared_copy=shared,
                                      embedding_or_output=True)  # optim.decoupled_lr drives it, the tied copy too
        if shared:  # zeros; build_model_chunks all-reduces the first stage's embedding into it
            w = torch.zeros(end - start, h)
        else:
            w = take_shard(context.init.normal("output_layer.weight", (vocab_size, h)), self._spec, end - start)
        self.weight = torch.nn.Parameter(w.to(device=context.device, dtype=context.params_dtype))

    def local_shard_specs(self) -> dict:
        return {} if self._spec is None else {"weight": self._spec}

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        return column_parallel_linear(x, w, None, self.groups, self.sequence_parallel,
                                      self.async_grad_allreduce, self.weight_main_grad)  # [s, b, V_pad/tp]


class GPTModel(torch.nn.Module):
    """One pipeline model chunk of the GPT (ARCHITECTURE.md contract).

    Args:
        config: ModelConfig. groups: ParallelGroups.
        parallel: ParallelConfig (sequence_parallel).
        pre_process: holds the embedding (first stage, chunk 0). post_process: holds the final
            norm and output layer (last stage, last chunk).
        layer_numbers: global 0-based layer indices of this chunk.
        vp_stage: virtual chunk index (None without interleaving).
        vocab_size: V, unpadded.
        params_dtype: dtype of params and activations. device: default ``groups.device``.
        seed: ``train.seed`` (init; and the RNG streams when ``rng_tracker`` is None).
        rng_tracker: the rank's shared RNGStatesTracker; None builds one (seeding torch's generators).

    Every layer of the chunk is built with one `LayerContext` (``context``: groups, effective sequence
    parallelism, params_dtype, device, init from (seed, name), the ``parallel`` TP-communication
    options). ``model.compile_layers`` is applied once built (`mptrain.layers.compile.apply_compile`,
    plan ``compile_plan``; ``compiled_chunk``, ``compile_mode``, ``compile_blocker`` say what it did).
    Raises:
        ConfigError: a bad node of the layer spec tree (see `mptrain.layers.spec`).
    """

    def __init__(self, config, groups, *, parallel, pre_process: bool, post_process: bool, layer_numbers: list,
                 vp_stage: Optional[int] = None, vocab_size: int, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, seed: int = 1234,
                 rng_tracker: Optional[RNGStatesTracker] = None) -> None:
        super().__init__()
        device = torch.device(device if device is not None else groups.device)
        self.config, self.groups, self.vocab_size = config, groups, vocab_size
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.layer_numbers = list(layer_numbers)
        self.tied = not config.untie_embeddings_and_output_weights
        self.rng_tracker = rng_tracker if rng_tracker is not None else init_rng_tracker(seed, groups, device)
        self.input_tensor = None
        init = ParamInit(seed=seed, std=config.init_method_std, num_layers=config.num_layers, device=device)
        self.context = layer_context(parallel, groups, init=init, params_dtype=params_dtype, device=device)
        self.sequence_parallel = self.context.sequence_parallel
        self.compile_plan: CompilePlan = plan_compile(config, groups, device, self.sequence_parallel)
        self._compiled_forward = None  # set by `compile`
        if pre_process:
            self.embedding = GPTEmbedding(config, self.context, vocab_size=vocab_size, rng_tracker=self.rng_tracker)
        # in the chunk graph the block skips its SP RNG fork (not traceable): dropout there draws its
        # TP-region masks as slices of whole-tensor masks (layers/random.py, "Dropout in a compiled chunk")
        self.decoder = TransformerBlock(config, self.context, layer_numbers=self.layer_numbers,
                                        rng_tracker=self.rng_tracker, final_norm=post_process,
                                        rng_fork=not self.compile_plan.chunk)
        if post_process:
            own = "untied" if not self.tied else ("none" if pre_process else "shared_copy")
            self.output_layer = OutputLayer(config, self.context, vocab_size=vocab_size, own_weight=own)
        apply_compile(self, self.compile_plan)

    @property
    def compiled_chunk(self) -> bool:
        """This chunk's forward is one compiled graph (``compile_scope=chunk``, nothing blocking it)."""
        return self.compile_plan.chunk

    @property
    def compile_mode(self) -> Optional[str]:
        """The ``torch.compile`` mode of the compiled regions (None: Inductor's default)."""
        return self.compile_plan.mode

    @property
    def compile_blocker(self) -> Optional[str]:
        """Why the chunk is not one graph (`mptrain.layers.compile.chunk_compile_blocker`); None when it is."""
        return self.compile_plan.blocker

    def compile(self, *args, **kwargs) -> None:
        """This chunk's forward as one ``torch.compile`` graph, in place (`mptrain.layers.compile.apply_compile`
        under ``compile_scope=chunk``); the received activations are a graph input, parameter names unchanged."""
        self._compiled_forward = torch.compile(self._forward, *args, **kwargs)

    def compile_per_layer(self, reason: str) -> None:
        """Compile each layer instead of the chunk as one graph, before the first forward (``torch.compile`` is
        lazy: nothing was traced yet); ``reason``: why, as the ``kernels:`` line gives it. A wrapper that acts
        around each layer (FSDP2 gathers a layer's params before its forward) needs the layers as regions of their
        own (`param_use_regions`): around one chunk graph it could act only around the whole chunk. Nothing to do
        when the chunk is not one graph."""
        if not self.compiled_chunk:
            return
        mode = compile_mode_for(self.config, self.groups, self.context.device, False)
        self.compile_plan = dataclasses.replace(self.compile_plan, chunk=False, blocker=reason, mode=mode)
        self._compiled_forward = None
        self.decoder.rng_fork = self.decoder.sequence_parallel  # eager between the layer graphs: the SP fork runs
        apply_compile(self, self.compile_plan)

    def set_input_tensor(self, input_tensor) -> None:
        """Activations ``[s(/tp), b, h]`` from the previous stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The tied word-embedding weight this chunk holds (first stage: the embedding; last stage: its copy)."""
        if not self.tied:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def output_weight(self) -> Optional[torch.Tensor]:
        """The weight the output layer multiplies by (last stage): its own, or the tied embedding's; else None."""
        if not self.post_process:
            return None
        return self.embedding.word_embeddings.weight if (self.tied and self.pre_process) else self.output_layer.weight

    def fuse_grad_accumulation(self, main_grad: MainGradOf) -> None:
        """`mptrain.layers.grad_accumulation_fusion.FusesGradAccumulation`: the output layer (last stage)
        accumulates into the ``main_grad`` of the weight it multiplies by (`output_weight`)."""
        if self.post_process:
            self.output_layer.weight_main_grad = main_grad(self.output_weight())

    def param_use_regions(self) -> list:
        """`mptrain.layers.param_use.ParamUseRegions`: the embedding, each layer, the final norm and the output layer,
        in forward order; the chunk alone when its forward is one compiled graph (``compile_scope=chunk``: this
        module's own pre-hooks stay eager, `compile`); the block for the layers when a layer's whole call is
        compiled (a user's layer compiled by ``torch.nn.Module.compile``, whose own pre-hooks are traced)."""
        if self.compiled_chunk:
            return [self]
        layers = list(self.decoder.layers.values())
        whole = self.compile_plan.compile_layers and any(type(m).compile is torch.nn.Module.compile for m in layers)
        regions = [self.embedding] if self.pre_process else []
        regions += [self.decoder] if whole else layers + [m for m in (self.decoder.final_layernorm,) if m is not None]
        return regions + ([self.output_layer] if self.post_process else [])

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """See the class docstring; returns per-token loss ``[b, s]`` fp32 (last stage, labels),
        logits ``[b, s, V_pad/tp]`` (last stage, no labels) or hidden ``[s(/tp), b, h]``.
        Under ``compile_scope=chunk`` one compiled graph (``compiled_chunk``). A `DocumentMask` as
        ``attention_mask`` gets what its backend reads built here, once for all layers and outside the graph."""
        if isinstance(attention_mask, DocumentMask):
            self._prepare_documents(attention_mask)
        if self._compiled_forward is not None:
            return self._compiled_forward(input_ids, position_ids, attention_mask, labels, self.input_tensor)
        return self._forward(input_ids, position_ids, attention_mask, labels, self.input_tensor)

    def _prepare_documents(self, mask: DocumentMask) -> None:
        """What the attention reads from the micro-batch's documents, built once for all layers: the ring's block
        plan under context parallelism with ``cp_comm_type=p2p`` (`mptrain.layers.cp_blocks`), else the
        document backend's structures over the whole sequence."""
        cp = getattr(self.groups, "cp_size", 1)
        if cp > 1 and self.context.cp_comm_type == "p2p":
            document_plan(mask, cp, self.groups.cp_rank)
            return
        dropout_p = self.config.attention_dropout if self.training else 0.0
        head_dim = self.config.kv_channels or self.config.hidden_size // self.config.num_attention_heads
        mask.prepare(document_backend(self.context.device, head_dim=head_dim, dropout_p=dropout_p))

    def _forward(self, input_ids, position_ids, attention_mask, labels, input_tensor) -> torch.Tensor:
        # the received activations are an argument, not an attribute read: a graph input per call
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)  # [s(/tp), b, h]
        else:
            hidden = input_tensor
        hidden = self.decoder(hidden, attention_mask)
        if not self.post_process:
            return hidden
        # its own weight is read inside its forward (where a data-parallel wrapper may gather it), the tied
        # embedding's is passed in
        own = self.output_layer.weight is not None
        logits = self.output_layer(hidden, None if own else self.output_weight())  # [s, b, V_pad/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V_pad/tp]
        loss = vocab_parallel_cross_entropy(logits, labels.t(), group=self.groups.tp_group, vocab_size=self.vocab_size,
                                            label_smoothing=self.config.label_smoothing,
                                            fused=self.compile_plan.fused_cross_entropy,
                                            inplace_backward=self.compile_plan.cross_entropy_inplace_backward)  # [s, b] fp32; the logits are ours
        return loss.t().contiguous()  # [b, s]


MODEL_KIND = ComponentKind(
    "model provider", methods=("forward", "set_input_tensor", "shared_embedding_or_output_weight", "output_weight"),
    runtime_keywords=("config", "groups", "parallel", "pre_process", "post_process", "layer_numbers", "vp_stage",
                      "vocab_size", "params_dtype", "device", "seed", "rng_tracker"),
    interface=GPTModel)
"""``model._target_``: called once per pipeline chunk with the runtime keywords above (Megatron's
``model_provider(pre_process, post_process)``); the result must follow `GPTModel`'s contract
(ARCHITECTURE.md "Model chunk"): ``forward``, ``set_input_tensor``, ``shared_embedding_or_output_weight``,
``output_weight``, attributes ``pre_process``, ``post_process``, ``rng_tracker``, global parameter names."""
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
"""Schema fields of the model node: the config the provider gets as ``config``, never keywords of its own."""


# --- construction -------------------------------------------------------------------------------
def build_model_chunks(model_cfg, parallel_cfg, groups, *, vocab_size: int, seed: int = 1234,
                       params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                       rng_tracker: Optional[RNGStatesTracker] = None) -> list:
    """This rank's model chunks (one per virtual stage), with the tied embedding synced.

    Builds one RNG tracker for the rank (`init_rng_tracker`, which seeds torch's generators)
    unless given; every chunk's ``rng_tracker`` is that object (checkpoint its state once).
    Collective over ``groups.embedding_group`` on the first and last stage when the embedding is
    tied and pp > 1: the last stage's zero copy becomes the first stage's weight (SUM all-reduce).

    The chunks come from the model provider ``model._target_`` (default `GPTModel`), built with
    `mptrain.components.build`; the config rules (`check_model_config`) ran in `validate_config`.
    Raises:
        ConfigError: a bad provider (see `check_model_components`), or a layer split that does not fit.
    """
    provider = build("model", model_cfg, MODEL_KIND, drop=MODEL_FIELDS, partial=True)
    device = torch.device(device if device is not None else groups.device)
    ranges = pipeline_layer_ranges(model_cfg.num_layers, groups.pp_size, groups.vpp_size,
                                   parallel_cfg.decoder_first_pipeline_num_layers,
                                   parallel_cfg.decoder_last_pipeline_num_layers)[groups.pp_rank]
    tracker = rng_tracker if rng_tracker is not None else init_rng_tracker(seed, groups, device)
    vpp = groups.vpp_size
    chunks = []
    for c, layer_numbers in enumerate(ranges):
        vp_stage = c if vpp else None
        chunks.append(provider(config=model_cfg, groups=groups, parallel=parallel_cfg,
                               pre_process=groups.is_pipeline_first_stage(vp_stage),
                               post_process=groups.is_pipeline_last_stage(vp_stage), layer_numbers=layer_numbers,
                               vp_stage=vp_stage, vocab_size=vocab_size, params_dtype=params_dtype, device=device,
                               seed=seed, rng_tracker=tracker))
    if groups.pp_size > 1 and not model_cfg.untie_embeddings_and_output_weights and groups.is_in_embedding_group:
        for chunk in chunks:
            weight = chunk.shared_embedding_or_output_weight()
            if weight is not None:
                with torch.no_grad():
                    dist.all_reduce(weight.data, group=groups.embedding_group)
    return chunks
