"""Megatron-LM's arguments and the mptrain keys they become: one row per argument (`ROWS`).

A row is what `mptrain.megatron.translate` needs to carry one argument of ``pretrain_gpt.py``:

- ``Row("--num-layers", "model.num_layers")``: the value as it is;
- ``Row("--swiglu", "model.activation", set="swiglu")``: a switch (no value) writes ``set``;
- ``Row("--fp16", "precision", set="fp16")``: a key without a dot is a config group's option;
- ``Row("--data-path", convert=data_path)``: ``convert(values) -> ["key=value", ...]``, for the
  arguments that become several keys or another unit; it raises `Uncarried` for a value that has
  no equivalent (``--fp8-format e4m3``); ``reads`` names the other arguments it needs
  (``--vocab-file`` reads ``--merge-file``, ``--tokenizer-type``), passed as keywords;
- ``status=NOTHING``: carried, nothing to set (mptrain always does it: ``--use-flash-attn``);
- ``status=NO_EQUIVALENT`` / ``GPU_ONLY`` / ``NOT_NEEDED``: not carried, ``why`` says why;
- ``default``: Megatron's value when the script leaves the argument out, written when mptrain's own
  default (as `conf/` composes it) differs; a callable ``default(args) -> value | None`` where
  Megatron derives it (``--lr-decay-iters`` = ``--train-iters``; None: nothing to write).

Adding an argument is one row. Megatron's defaults are those of Megatron-LM's
``megatron/training/arguments.py`` and the config dataclasses it reads
(``megatron/core/transformer/transformer_config.py``, ``megatron/core/optimizer/optimizer_config.py``,
``megatron/training/config/training_config.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

CARRIED = "carried"
NOTHING = "carried: nothing to set"
NO_EQUIVALENT = "no equivalent yet"
GPU_ONLY = "GPU-only"
NOT_NEEDED = "not needed in mptrain"
UNCARRIED = (NO_EQUIVALENT, GPU_ONLY, NOT_NEEDED)

VALUE = object()
"""`Row.set`'s default: the argument's own value (a switch without ``set`` writes true)."""
UNSET = object()
"""`Row.default`'s default: Megatron's default is mptrain's, or the argument has none."""


class Uncarried(Exception):
    """Raised by a row's ``convert`` for a value with no mptrain equivalent: ``(status, why)``."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


@dataclasses.dataclass(frozen=True)
class Row:
    flag: str
    """Megatron's argument, ``--num-layers``."""
    key: Optional[str] = None
    """The mptrain key (``model.num_layers``) or config group (``precision``); None with ``convert`` or when not carried."""
    set: Any = VALUE
    """For a switch: the value it writes (default true)."""
    convert: Optional[Callable] = None
    """``convert(values: list[str]) -> list["key=value"]`` (values as the script gives them, quotes stripped)."""
    default: Any = UNSET
    """Megatron's default, or ``default(args: dict[flag, list[str]]) -> value | None``."""
    status: str = CARRIED
    why: str = ""
    """For NOTHING and the uncarried statuses: the reason, one sentence."""
    takes_value: bool = True
    """False for a switch (``--fp16``); a switch given a value is reported."""
    reads: tuple = ()
    """Other arguments ``convert`` needs: ``convert(values, **self.read_from(given))``; ``"world_size"`` (no
    dashes): the launch's process count, which Megatron reads from the launcher."""

    def read_from(self, given: dict, world_size: int = 1) -> dict:
        """``{"merge_file": values or None, ..., "world_size": N}``: the values of ``reads`` in ``given``
        ({flag: values}) and the launch's ``world_size``."""
        return {flag[2:].replace("-", "_") if flag.startswith("--") else flag:
                given.get(flag) if flag.startswith("--") else world_size for flag in self.reads}


def switch(flag: str, key: Optional[str] = None, set: Any = True, **kw) -> Row:
    """A store_true / store_false argument (``--sequence-parallel``, ``--no-load-optim``)."""
    return Row(flag, key, set=set, takes_value=False, **kw)


def nothing(flag: str, why: str, takes_value: bool = False) -> Row:
    return Row(flag, status=NOTHING, why=why, takes_value=takes_value)


def uncarried(flag: str, status: str, why: str, takes_value: bool = True) -> Row:
    return Row(flag, status=status, why=why, takes_value=takes_value)


def hydra_value(text: str) -> str:
    """``text`` as a Hydra override value: quoted where Hydra's grammar would read it otherwise."""
    plain = all(c.isalnum() or c in "_-+./~" for c in text) and text != ""
    return text if plain else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _prefix_list(values: list) -> str:
    """``[A]``, or ``[0.3,A,0.7,B]`` for Megatron's weighted blend ``0.3 A 0.7 B``."""
    return "[" + ",".join(hydra_value(v) for v in values) + "]"


def data_path(values: list) -> list:
    """data=indexed data.prefixes=[PREFIX] (a blend 0.3 A 0.7 B: [0.3,A,0.7,B])."""
    return ["data=indexed", f"data.prefixes={_prefix_list(values)}"]


def split(values: list) -> list:
    """data.split="949,50,1"."""
    return [f"data.split={hydra_value(''.join(values).replace(' ', ''))}"]


def prefixes(key: str) -> Callable:
    return lambda values: ["data=indexed", f"{key}={_prefix_list(values)}"]


def optimizer(values: list) -> list:
    """adam: optim=adamw (Megatron's adam decouples weight decay); sgd: optim=sgd."""
    choice = values[0]
    if choice == "adam":  # Megatron's adam is decoupled weight decay (optimizer_config.decoupled_weight_decay=True)
        return ["optim=adamw"]
    if choice == "sgd":
        return ["optim=sgd"]
    raise Uncarried(NO_EQUIVALENT, f"--optimizer {choice}: mptrain ships adam / adamw / sgd (any torch optimizer: optim._target_)")


def fp8_format(values: list) -> list:
    if values[0] == "hybrid":  # torchao's float8: e4m3 forward, e5m2 gradients
        return ["precision=fp8"]
    raise Uncarried(NO_EQUIVALENT, f"--fp8-format {values[0]}: mptrain's fp8 is hybrid (e4m3 forward, e5m2 gradients)")


def attention_backend(values: list) -> list:
    if values[0] in ("unfused", "local"):
        return ["model.attention_backend=unfused"]
    # auto / flash / fused: SDPA picks flash or cuDNN attention itself (mptrain's auto)
    return []


def context_parallel_size(values: list) -> list:
    """parallel.context_parallel_size=N; 1 is mptrain's default (nothing to set)."""
    return [] if values[0] == "1" else [f"parallel.context_parallel_size={values[0]}"]


def cp_comm_type(values: list) -> list:
    """parallel.cp_comm_type: Megatron's list (one type per layer) must name one type, p2p (mptrain's default),
    all_gather (``allgather`` in Megatron's help text) or a2a; a2a+p2p (hierarchical) has no equivalent."""
    kinds = {"allgather": "all_gather"}
    types = {kinds.get(v, v) for v in values}
    if types == {"p2p"}:
        return []
    if len(types) == 1 and types <= {"all_gather", "a2a"}:
        return [f"parallel.cp_comm_type={types.pop()}"]
    raise Uncarried(NO_EQUIVALENT, f"--cp-comm-type {' '.join(values)}: mptrain's context parallelism is p2p, "
                                   "all_gather or a2a, one type for every layer")


def moe_layer_freq(values: list) -> list:
    """model.moe_layer_freq=N, or a list of 0/1 (Megatron's Python expression, e.g. ``([0]+[1]*3)*2``)."""
    import ast

    text = values[0]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = _list_expression(text)
    if isinstance(value, int):
        return [f"model.moe_layer_freq={value}"]
    return [f"model.moe_layer_freq=[{','.join(str(int(v)) for v in value)}]"]


def _list_expression(text: str) -> list:
    """Megatron's ``--moe-layer-freq`` list expressions: list literals joined by ``+`` and repeated by ``*``
    with integers, as ``([0]+[1]*3)*2``; evaluated on the syntax tree (no eval)."""
    import ast

    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise Uncarried(NO_EQUIVALENT, f"--moe-layer-freq {text}: give an integer or a list of 0/1 ([1,0,1,0] or "
                                       "([0]+[1]*3)*2)")

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, TypeError):
        result = None
    if not isinstance(result, list):
        raise Uncarried(NO_EQUIVALENT, f"--moe-layer-freq {text}: give an integer or a list of 0/1")
    return result


def one_value(flag: str, key: str) -> Callable:
    """An argument Megatron takes as a list (``nargs='+'``, one value per aux-loss type): one value carried."""
    def convert(values: list) -> list:
        if len(values) != 1:
            raise Uncarried(NO_EQUIVALENT, f"{flag} {' '.join(values)}: mptrain takes one load-balancing type")
        return [f"{key}={values[0]}"]
    return convert


def tensorboard(values: list) -> list:
    """logger=tensorboard logger.tensorboard_dir=DIR."""
    return ["logger=tensorboard", f"logger.tensorboard_dir={hydra_value(values[0])}"]


def profile_ranks(values: list) -> list:
    """train.profile_ranks=[0,1] (Megatron's nargs='+')."""
    return [f"train.profile_ranks=[{','.join(values)}]"]


TOKENIZER_NODE = "++data.tokenizer="
"""A tokenizer node replaces data.tokenizer's keys (``++``: Hydra adds the keys the option's node lacks, as
vocab_file to data=indexed's ByteTokenizer, which a plain ``data.tokenizer={...}`` refuses)."""


def gpt2_bpe(values: list, *, merge_file: Optional[list] = None, tokenizer_type: Optional[list] = None,
             mock_data: Optional[list] = None) -> list:
    """++data.tokenizer={_target_:mptrain.data.tokenizers.GPT2BPETokenizer,vocab_file:V,merge_file:M} (Megatron's
    GPT2BPETokenizer: --merge-file M, --tokenizer-type GPT2BPETokenizer or none)."""
    kind = tokenizer_type[0] if tokenizer_type else "GPT2BPETokenizer"
    if mock_data is not None:  # given (a switch: no values)
        raise Uncarried(NOT_NEEDED, "with --mock-data: data=mock's ids come from its NullTokenizer (data.vocab_size)")
    if kind.startswith("BertWordPiece"):
        raise Uncarried(NO_EQUIVALENT, f"--tokenizer-type {kind}: BERT's WordPiece vocabulary; mptrain trains GPT models")
    if kind != "GPT2BPETokenizer":  # HuggingFaceTokenizer, TikTokenizer, ...: Megatron reads --tokenizer-model
        raise Uncarried(NOT_NEEDED, f"--tokenizer-type {kind} does not read --vocab-file")
    if not merge_file:
        raise Uncarried(NO_EQUIVALENT, "GPT2BPETokenizer needs --merge-file beside --vocab-file (gpt2-merges.txt)")
    vocab, merges = hydra_value(values[0]), hydra_value(merge_file[0])
    return [f"{TOKENIZER_NODE}{{_target_:mptrain.data.tokenizers.GPT2BPETokenizer,vocab_file:{vocab},merge_file:{merges}}}"]


def hf_tokenizer(values: list) -> list:
    """++data.tokenizer={_target_:mptrain.data.tokenizers.HFTokenizer,tokenizer_json:MODEL/tokenizer.json}."""
    path = hydra_value(values[0].rstrip("/") + "/tokenizer.json")
    return [f"{TOKENIZER_NODE}{{_target_:mptrain.data.tokenizers.HFTokenizer,tokenizer_json:{path}}}"]


def rampup_batch_size(values: list) -> list:
    """train.rampup_batch_size=[start,increment,ramp_samples] (the three values as given; the run checks them)."""
    return [f"train.rampup_batch_size=[{','.join(v.strip() for v in values)}]"]


def step_batch_size_schedule(values: list) -> list:
    """train.step_batch_size_schedule="THRESHOLD:BATCH ..." (Megatron's one string as given; the run checks it)."""
    return [f"train.step_batch_size_schedule={hydra_value(' '.join(v.strip() for v in values))}"]


def load(values: list) -> list:
    """checkpoint.load=DIR (the row's ``why`` says what a Megatron-LM checkpoint there needs)."""
    return [f"checkpoint.load={hydra_value(values[0])}"]


def minutes_to_s(key: str) -> Callable:
    return lambda values: [f"{key}={float(values[0]) * 60:g}"]


def loss_scale(values: list) -> list:
    """loss_scaler=constant loss_scaler.scale=S."""
    return ["loss_scaler=constant", f"loss_scaler.scale={values[0]}"]


def sharding_strategy(values: list, *, use_megatron_fsdp: Optional[list] = None,
                      use_custom_fsdp: Optional[list] = None) -> list:
    """parallel.data_parallel_sharding_strategy=S under --use-megatron-fsdp (--use-custom-fsdp, its older name):
    Megatron reads the strategy there only (mptrain's ZeRO-2 / ZeRO-3 run on torch's FSDP2)."""
    if use_megatron_fsdp is None and use_custom_fsdp is None:
        raise Uncarried(NOT_NEEDED, "without --use-megatron-fsdp Megatron does not read it")
    return [f"parallel.data_parallel_sharding_strategy={hydra_value(values[0])}"]


FSDP_READS = ("--use-megatron-fsdp", "--use-custom-fsdp", "--data-parallel-sharding-strategy")


def _megatron_fsdp_shards(use_megatron_fsdp: Optional[list], use_custom_fsdp: Optional[list],
                          data_parallel_sharding_strategy: Optional[list]) -> bool:
    """Megatron-FSDP runs ZeRO-2 / ZeRO-3 (optim_grads / optim_grads_params): what mptrain's FSDP2 keys act on."""
    fsdp = use_megatron_fsdp is not None or use_custom_fsdp is not None
    strategy = (data_parallel_sharding_strategy or ["no_shard"])[0]
    return fsdp and strategy in ("optim_grads", "optim_grads_params")


def distributed_optimizer_instances(values: list, *, world_size: int, tensor_model_parallel_size=None,
                                    pipeline_model_parallel_size=None, **fsdp: Optional[list]) -> list:
    """--num-distributed-optimizer-instances N: Megatron shards within N groups of dp·cp / N consecutive DP ranks
    (its intra-instance groups) and replicates across them. Under Megatron-FSDP's ZeRO-2 / ZeRO-3 (HSDP) that is
    parallel.data_parallel_shard_size = dp·cp / N; ZeRO-1 within groups (a partial distributed optimizer) has no
    equivalent (mptrain's ZeRO-1 shards over the whole DP group)."""
    instances = int(values[0])
    if instances == 1:
        return []
    if not _megatron_fsdp_shards(**fsdp):
        raise Uncarried(NO_EQUIVALENT, f"ZeRO-1 sharded within {instances} groups: mptrain's distributed optimizer "
                                       "shards over the whole DP group (parallel.data_parallel_shard_size, HSDP, "
                                       "needs optim_grads / optim_grads_params)")
    tp, pp = (int((v or ["1"])[0]) for v in (tensor_model_parallel_size, pipeline_model_parallel_size))
    dp_cp = world_size // (tp * pp)
    if dp_cp % instances:
        raise Uncarried(NO_EQUIVALENT, f"{instances} instances do not divide the data-parallel size {dp_cp} of "
                                       f"world size {world_size}")
    return [f"parallel.data_parallel_shard_size={dp_cp // instances}"]


def optimizer_cpu_offload(values: list, **fsdp: Optional[list]) -> list:
    """--optimizer-cpu-offload: optim.optimizer_cpu_offload=true under Megatron-FSDP's ZeRO-2 / ZeRO-3 (FSDP2 keeps
    the fp32 shards, grads and optimizer state in host memory); with ZeRO-1 it has no equivalent."""
    if not _megatron_fsdp_shards(**fsdp):
        raise Uncarried(NO_EQUIVALENT, "mptrain offloads the shards of ZeRO-2 / ZeRO-3 (FSDP2), not ZeRO-1's "
                                       "optimizer state")
    return ["optim.optimizer_cpu_offload=true"]


def optimizer_offload_fraction(values: list) -> list:
    """--optimizer-offload-fraction F: 1.0 (Megatron's default) is what optim.optimizer_cpu_offload offloads."""
    if float(values[0]) == 1.0:
        return []
    raise Uncarried(NO_EQUIVALENT, f"--optimizer-offload-fraction {values[0]}: mptrain offloads all of the shards "
                                   "(1.0) or none")


def _lr_decay_iters(args: dict) -> Optional[str]:
    """Megatron: unset --lr-decay-iters decays over the whole run (--train-iters)."""
    if "--lr-decay-samples" in args or "--train-iters" not in args:
        return None
    return args["--train-iters"][0]


def _ffn_hidden_size(args: dict) -> Optional[int]:
    """Megatron: 4h, or with --swiglu int(4h · 2/3 / 64) · 64 (mptrain's null is 4h either way)."""
    if "--swiglu" not in args or "--hidden-size" not in args:
        return None
    return int((4 * int(args["--hidden-size"][0]) * 2 / 3) / 64) * 64


def _grad_reduce_in_fp32(args: dict) -> Optional[bool]:
    """Megatron accumulates and reduces bf16 runs' grads in fp32 unless --grad-reduce-in-bf16."""
    return True if "--bf16" in args and "--grad-reduce-in-bf16" not in args else None


def _global_batch_size(args: dict) -> None:
    """micro × dp"""
    return None  # written by translate.py, which knows the world size


def _sgd_momentum(args: dict) -> Optional[float]:
    """`0.9` (with --optimizer sgd)"""
    return 0.9 if args.get("--optimizer") == ["sgd"] else None


SAMPLES_WHY = "counts samples where mptrain counts iterations"

ROWS: tuple = (
    # model
    Row("--num-layers", "model.num_layers"),
    Row("--hidden-size", "model.hidden_size"),
    Row("--num-attention-heads", "model.num_attention_heads"),
    Row("--num-query-groups", "model.num_query_groups"),
    nothing("--group-query-attention", "model.num_query_groups sets grouped-query attention"),
    Row("--ffn-hidden-size", "model.ffn_hidden_size", default=_ffn_hidden_size),
    Row("--kv-channels", "model.kv_channels"),
    Row("--seq-length", "model.seq_length"),
    Row("--max-position-embeddings", "model.max_position_embeddings"),
    Row("--vocab-size", "model.vocab_size"),
    Row("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by"),
    switch("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights"),
    Row("--hidden-dropout", "model.hidden_dropout", default=0.1),
    Row("--attention-dropout", "model.attention_dropout", default=0.1),
    Row("--init-method-std", "model.init_method_std"),
    Row("--normalization", "model.normalization"),
    Row("--norm-epsilon", "model.layernorm_epsilon"),
    switch("--swiglu", "model.activation", set="swiglu"),
    Row("--position-embedding-type", "model.position_embedding_type"),
    Row("--rotary-base", "model.rotary_base"),
    switch("--use-rope-scaling", "model.rope_scaling"),
    Row("--rope-scaling-factor", "model.rope_scaling_factor"),
    switch("--disable-bias-linear", "model.add_bias_linear", set=False),
    switch("--add-qkv-bias", "model.add_qkv_bias"),
    switch("--qk-layernorm", "model.qk_layernorm"),
    switch("--attention-softmax-in-fp32", "model.attention_softmax_in_fp32"),
    Row("--recompute-granularity", "model.recompute_granularity"),
    Row("--recompute-method", "model.recompute_method"),
    Row("--recompute-num-layers", "model.recompute_num_layers"),
    Row("--attention-backend", convert=attention_backend,
        why="auto / flash / fused: nothing to set (SDPA picks the flash or cuDNN kernel); unfused / local: model.attention_backend=unfused"),
    nothing("--use-flash-attn", "SDPA picks the flash kernel where it applies"),
    nothing("--use-mcore-models", "mptrain has one model implementation (Megatron-core's layer structure)"),
    nothing("--cross-entropy-loss-fusion", "the vocab-parallel cross entropy is fused by torch.compile on CUDA (model.compile_layers)"),
    # mixture of experts
    Row("--num-experts", "model.num_moe_experts"),
    Row("--moe-layer-freq", convert=moe_layer_freq, why="model.moe_layer_freq=N or [0/1 per layer]"),
    Row("--moe-ffn-hidden-size", "model.moe_ffn_hidden_size"),
    Row("--moe-router-topk", "model.moe_router_topk"),
    Row("--moe-router-score-function", "model.moe_router_score_function"),
    switch("--moe-router-pre-softmax", "model.moe_router_pre_softmax"),
    Row("--moe-router-topk-scaling-factor", "model.moe_router_topk_scaling_factor"),
    Row("--moe-router-load-balancing-type", convert=one_value("--moe-router-load-balancing-type",
                                                             "model.moe_router_load_balancing_type"),
        why="model.moe_router_load_balancing_type (one type)"),
    Row("--moe-aux-loss-coeff", convert=one_value("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff"),
        why="model.moe_aux_loss_coeff (one coefficient)"),
    Row("--moe-z-loss-coeff", "model.moe_z_loss_coeff"),
    switch("--moe-router-enable-expert-bias", "model.moe_router_enable_expert_bias"),
    Row("--moe-router-bias-update-rate", "model.moe_router_bias_update_rate"),
    Row("--moe-router-dtype", "model.moe_router_dtype"),
    Row("--moe-input-jitter-eps", "model.moe_input_jitter_eps"),
    Row("--moe-expert-capacity-factor", "model.moe_expert_capacity_factor"),
    switch("--moe-pad-expert-input-to-capacity", "model.moe_pad_expert_input_to_capacity"),
    Row("--moe-token-drop-policy", "model.moe_token_drop_policy"),
    Row("--moe-token-dispatcher-type", "model.moe_token_dispatcher_type"),
    switch("--moe-grouped-gemm", "model.moe_grouped_gemm"),
    Row("--moe-shared-expert-intermediate-size", "model.moe_shared_expert_intermediate_size"),
    switch("--moe-shared-expert-gate", "model.moe_shared_expert_gate"),
    # parallel
    Row("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size"),
    Row("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size"),
    Row("--virtual-pipeline-model-parallel-size", "parallel.virtual_pipeline_model_parallel_size"),
    Row("--decoder-first-pipeline-num-layers", "parallel.decoder_first_pipeline_num_layers"),
    Row("--decoder-last-pipeline-num-layers", "parallel.decoder_last_pipeline_num_layers"),
    switch("--sequence-parallel", "parallel.sequence_parallel"),
    switch("--tp-comm-overlap", "parallel.tp_comm_overlap"),
    switch("--no-gradient-accumulation-fusion", "parallel.gradient_accumulation_fusion", set=False),
    switch("--use-distributed-optimizer", "parallel.use_distributed_optimizer"),
    Row("--data-parallel-sharding-strategy", convert=sharding_strategy, reads=("--use-megatron-fsdp", "--use-custom-fsdp"),
        why="parallel.data_parallel_sharding_strategy (with --use-megatron-fsdp)"),
    nothing("--use-megatron-fsdp", "parallel.data_parallel_sharding_strategy=optim_grads / optim_grads_params shards "
            "on torch's FSDP2"),
    nothing("--use-custom-fsdp", "parallel.data_parallel_sharding_strategy=optim_grads / optim_grads_params shards "
            "on torch's FSDP2"),
    Row("--num-distributed-optimizer-instances", convert=distributed_optimizer_instances,
        reads=("world_size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size", *FSDP_READS),
        why="parallel.data_parallel_shard_size = dp·cp / N under --use-megatron-fsdp ZeRO-2 / ZeRO-3 (HSDP); "
            "1: nothing to set"),
    switch("--optimizer-cpu-offload", convert=optimizer_cpu_offload, reads=FSDP_READS,
           why="optim.optimizer_cpu_offload (FSDP2's CPUOffloadPolicy) under --use-megatron-fsdp ZeRO-2 / ZeRO-3"),
    Row("--optimizer-offload-fraction", convert=optimizer_offload_fraction,
        why="1.0: nothing to set (optim.optimizer_cpu_offload offloads every shard); other fractions: no equivalent"),
    switch("--overlap-grad-reduce", "parallel.overlap_grad_reduce"),
    switch("--accumulate-allreduce-grads-in-fp32", "parallel.grad_reduce_in_fp32", default=_grad_reduce_in_fp32),
    switch("--grad-reduce-in-bf16", "parallel.grad_reduce_in_fp32", set=False),
    Row("--ddp-bucket-size", "parallel.bucket_size"),
    Row("--context-parallel-size", convert=context_parallel_size,
        why="parallel.context_parallel_size (1: nothing to set)"),
    Row("--cp-comm-type", convert=cp_comm_type,
        why="parallel.cp_comm_type: p2p (nothing to set), all_gather or a2a; a2a+p2p has no equivalent"),
    Row("--expert-model-parallel-size", "parallel.expert_model_parallel_size"),
    Row("--expert-tensor-parallel-size", "parallel.expert_tensor_parallel_size"),
    switch("--overlap-param-gather", "parallel.overlap_param_gather"),
    # precision
    switch("--fp16", "precision", set="fp16"),
    switch("--bf16", "precision", set="bf16"),
    Row("--fp8-format", convert=fp8_format, why="hybrid: precision=fp8 (torchao's float8, e4m3 forward, e5m2 gradients)"),
    Row("--first-last-layers-bf16", "precision.fp8_first_last_layers_bf16", takes_value=False, set=1),
    uncarried("--fp8-amax-history-len", GPU_ONLY,
              "Transformer Engine's delayed scaling; mptrain's fp8 scales each tensor from its current amax (torchao)"),
    uncarried("--fp8-amax-compute-algo", GPU_ONLY,
              "Transformer Engine's delayed scaling; mptrain's fp8 scales each tensor from its current amax (torchao)"),
    uncarried("--fp8-param-gather", GPU_ONLY,
              "Transformer Engine's fp8 parameters; mptrain keeps bf16 params and casts them to fp8 once per iteration "
              "(under ZeRO-2 / ZeRO-3 in each GEMM, after the bf16 all-gather)", False),
    Row("--loss-scale", convert=loss_scale),
    Row("--initial-loss-scale", "loss_scaler.initial_scale"),
    Row("--min-loss-scale", "loss_scaler.min_scale"),
    Row("--loss-scale-window", "loss_scaler.growth_interval"),
    Row("--hysteresis", "loss_scaler.hysteresis"),
    # optim
    Row("--optimizer", convert=optimizer, default="adam"),
    Row("--lr", "optim.lr"),
    Row("--min-lr", "optim.min_lr"),
    Row("--weight-decay", "optim.weight_decay", default=0.01),
    Row("--adam-beta1", "optim.adam_beta1"),
    Row("--adam-beta2", "optim.adam_beta2"),
    Row("--adam-eps", "optim.adam_eps"),
    Row("--sgd-momentum", "optim.sgd_momentum", default=_sgd_momentum),
    Row("--lr-warmup-iters", "optim.lr_warmup_iters"),
    Row("--lr-decay-iters", "optim.lr_decay_iters", default=_lr_decay_iters),
    Row("--lr-decay-style", "optim.lr_decay_style", default="linear"),
    Row("--lr-wsd-decay-iters", "optim.lr_wsd_decay_iters"),
    Row("--lr-wsd-decay-style", "optim.lr_wsd_decay_style"),
    Row("--clip-grad", "train.clip_grad"),
    Row("--decoupled-lr", "optim.decoupled_lr"),
    Row("--decoupled-min-lr", "optim.decoupled_min_lr"),
    # train
    Row("--micro-batch-size", "train.micro_batch_size"),
    Row("--global-batch-size", "train.global_batch_size", default=_global_batch_size),
    Row("--train-iters", "train.train_iters"),
    Row("--seed", "train.seed"),
    Row("--log-interval", "train.log_interval", default=100),
    Row("--eval-interval", "train.eval_interval", default=None),
    Row("--eval-iters", "train.eval_iters", default=100),
    Row("--exit-interval", "train.exit_interval"),
    Row("--distributed-timeout-minutes", convert=minutes_to_s("train.timeout_s"), why="train.timeout_s (seconds: minutes × 60)"),
    switch("--manual-gc", "train.manual_gc"),
    Row("--manual-gc-interval", "train.manual_gc_interval"),
    switch("--no-manual-gc-eval", "train.manual_gc_eval", set=False),
    Row("--timing-log-level", "train.timing_log_level", default=0),
    nothing("--calculate-per-token-loss", "the loss is always the mean over the global batch's loss-masked tokens"),
    nothing("--log-throughput", "every metrics.jsonl row has tokens_per_s, tflops_per_gpu and mfu"),
    Row("--step-batch-size-schedule", convert=step_batch_size_schedule,
        why='train.step_batch_size_schedule="0:16 2.4B:320 ..." (thresholds in tokens, as Megatron\'s)'),
    Row("--rampup-batch-size", convert=rampup_batch_size,
        why="train.rampup_batch_size=[start,increment,ramp_samples] (needs --train-samples, as in Megatron)"),
    uncarried("--empty-unused-memory-level", GPU_ONLY, "torch.cuda.empty_cache after steps; mptrain leaves the caching allocator alone"),
    switch("--profile", "train.profile"),
    Row("--profile-step-start", "train.profile_step_start"),
    Row("--profile-step-end", "train.profile_step_end"),
    Row("--profile-ranks", convert=profile_ranks, why="train.profile_ranks=[R,...]"),
    switch("--use-pytorch-profiler", "train.use_pytorch_profiler"),
    # checkpoint
    Row("--save", "checkpoint.save"),
    Row("--load", convert=load, why="`checkpoint.load`; a Megatron-LM checkpoint there is imported once first (python "
        "-m mptrain.export --import-megatron DIR --output CKPT, then checkpoint.load=CKPT: a run refuses Megatron's folder)"),
    Row("--save-interval", "checkpoint.save_interval"),
    switch("--finetune", "checkpoint.finetune"),
    switch("--no-load-optim", "checkpoint.load_optim", set=False),
    switch("--no-load-rng", "checkpoint.load_rng", set=False),
    switch("--use-checkpoint-args", "checkpoint.use_checkpoint_args"),
    switch("--async-save", "checkpoint.async_save"),
    nothing("--ckpt-format", "mptrain has one checkpoint format, torch.distributed.checkpoint shards that reshard on load "
            "(as torch_dist); a Megatron-LM checkpoint (torch_dist or torch) is imported once with python -m "
            "mptrain.export --import-megatron DIR --output CKPT", takes_value=True),
    # data
    Row("--data-path", convert=data_path),
    Row("--train-data-path", convert=prefixes("data.train_prefixes"), why="data=indexed data.train_prefixes=[...]"),
    Row("--valid-data-path", convert=prefixes("data.valid_prefixes"), why="data=indexed data.valid_prefixes=[...]"),
    Row("--test-data-path", convert=prefixes("data.test_prefixes"), why="data=indexed data.test_prefixes=[...]"),
    Row("--split", convert=split),
    switch("--mock-data", "data", set="mock"),
    Row("--vocab-file", convert=gpt2_bpe, reads=("--merge-file", "--tokenizer-type", "--mock-data"),
        why="++data.tokenizer={_target_:mptrain.data.tokenizers.GPT2BPETokenizer,vocab_file:V,merge_file:M} "
            "(with --merge-file M; --tokenizer-type GPT2BPETokenizer or none)"),
    nothing("--merge-file", "read with --vocab-file (GPT2BPETokenizer's merge_file)", takes_value=True),
    nothing("--tokenizer-type", "the tokenizer follows from its files: --vocab-file / --merge-file's GPT2BPETokenizer, "
            "--tokenizer-model's Hugging Face tokenizer, mock data's NullTokenizer", takes_value=True),
    Row("--tokenizer-model", convert=hf_tokenizer),
    Row("--data-cache-path", "data.cache_dir"),
    switch("--reset-position-ids", "data.reset_position_ids"),
    switch("--reset-attention-mask", "data.reset_attention_mask"),
    switch("--eod-mask-loss", "data.eod_mask_loss"),
    nothing("--no-create-attention-mask-in-dataloader",
            "the default (data.create_attention_mask_in_dataloader=false): no [b,1,s,s] mask; with "
            "data.reset_attention_mask the batch carries document offsets"),
    uncarried("--no-mmap-bin-files", NOT_NEEDED, "the .bin files are always memory-mapped; the tokens read are the same", False),
    uncarried("--num-workers", NOT_NEEDED, "batches are read in the training process (a prefetch thread on CUDA), no worker processes"),
    uncarried("--tiktoken-pattern", NOT_NEEDED, "it configures Megatron's TikTokenizer, which --tokenizer-type does not select here"),
    # logger
    Row("--wandb-project", convert=lambda v: ["logger=wandb", f"logger.project={hydra_value(v[0])}"],
        why="logger=wandb logger.project=NAME"),
    Row("--wandb-exp-name", "logger.run_name"),

    # schedules by samples, the LR warm-up fraction, layer options, the wall-clock exit, TensorBoard's folder
    Row("--tensorboard-dir", convert=tensorboard),
    Row("--lr-warmup-fraction", "optim.lr_warmup_fraction"),
    Row("--train-samples", convert=lambda v: [f"train.train_samples={v[0]}", "train.train_iters=null"],
        why="train.train_samples=N train.train_iters=null (mptrain's preset sets train_iters)"),
    Row("--lr-warmup-samples", "optim.lr_warmup_samples"),
    Row("--lr-decay-samples", "optim.lr_decay_samples"),
    switch("--apply-layernorm-1p", "model.apply_layernorm_1p"),
    Row("--rotary-percent", "model.rotary_percent"),
    Row("--exit-duration-in-mins", "train.exit_duration_in_mins"),
    switch("--recompute-activations", "model.recompute_activations"),
)


BY_FLAG = {row.flag: row for row in ROWS}
assert len(BY_FLAG) == len(ROWS), "a Megatron argument has two rows"
