"""The benchmark configs and the commands that run them (mptrain and the megatron-core peer).

A `BenchConfig` is one model shape × layout × precision × batch, run by both trainers with the same
micro-batch size, number of micro-batches, warm-up and timed iterations. Global batch
= micro_batch_size × num_microbatches × dp, dp = gpus / (tp × pp). Tokens per iteration T = global
batch × seq_length.

FLOPs per iteration: `mptrain.layers.params.flops_per_iteration` (DESIGN.md §2, the function the
trainer's metrics and the planner call), with V_pad the vocab padded to a multiple of 128 × tp. For
these plain-GPT shapes it is the peer's F = 6·N·T + 12·L·h·s·T, N = 12·L·h² + V_pad·h.

Suites (`suite(name, gpus)`): ``quick`` (a harness smoke test: 2 timed iterations of small and
real shapes), ``full`` (configs a-d against megatron-core, ordered by priority so that a time budget cuts the
least important ones), ``ceiling`` (only the plain-PyTorch reference `bench/peer/torch_ceiling.py`),
``fp8`` (mptrain bf16 / fp8 tensorwise / fp8 rowwise, each beside the plain-PyTorch GPT in the same
precision: torchao's ``convert_to_float8_training`` on its block linears), ``moe`` (one GPU: mptrain's default
command at ``moe_mixtral_small`` beside the compiled plain-PyTorch MoE `bench/peer/torch_moe.py`, the routing and
permutation share `bench/moe_share.py`, and the dense gpt_1.3b beside its plain-PyTorch GPT), ``x8`` (the 8-GPU
table: `bench/x8.py`), ``zero`` (one GPU: every data-parallel strategy at dp = 1 against no_shard, ZeRO-3 with
CPU offload against without: `_zero`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from mptrain.config.model import ModelConfig
from mptrain.layers.embedding import padded_vocab_size
from mptrain.layers.params import DEFAULT_PEAK_TFLOPS
from mptrain.layers.params import flops_per_iteration as model_flops_per_iteration

PEAK_TFLOPS_BF16_DENSE = DEFAULT_PEAK_TFLOPS  # H100 / H200 SXM dense bf16, used for every precision
CONF_MODEL = Path(__file__).resolve().parents[1] / "conf" / "model"
MOE_PRESETS = ("moe_mixtral_small", "moe_tiny")  # presets whose FLOPs need their whole YAML (`preset_model_config`)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A `conf/model/<name>.yaml` preset's sizes (tests check they match the YAML)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int


MODEL_SHAPES = {
    "seed_2.8b": ModelShape(12, 4096, 8, 1024, 50257),
    "gpt_1.3b": ModelShape(24, 2048, 16, 2048, 50257),
    "gpt_125m": ModelShape(12, 768, 12, 2048, 50257),
    "tiny": ModelShape(4, 64, 4, 64, 1000),  # CPU tests only (vocab = data=mock's default)
    "gpt_350m": ModelShape(24, 1024, 16, 2048, 50257),
    "gpt_6.7b": ModelShape(32, 4096, 32, 2048, 50257),
    "gpt_2.7b": ModelShape(32, 2560, 32, 2048, 50257),
    "moe_mixtral_small": ModelShape(12, 1024, 16, 2048, 32000),  # MoE: FLOPs from the whole preset
}

# Bench-only shapes of the single-GPU table (no conf/model preset of their own): name -> (the preset
# they override, the shape). `mptrain_overrides` passes their sizes as model.* overrides.
BENCH_SHAPES = {
    "gpt_11m_s256": ("gpt_125m", ModelShape(6, 384, 6, 256, 50257)),
    "gpt_124m_s1024": ("gpt_125m", ModelShape(12, 768, 12, 1024, 50257)),
    "gpt_6x384_v65": ("gpt_125m", ModelShape(6, 384, 6, 256, 65)),  # a character-level model (Shakespeare's 65)
    # the same model at the byte tokenizer's vocabulary (256 bytes + EOD), so that mock data and the shipped
    # Shakespeare corpus (data=shakespeare) feed the same model
    "gpt_6x384_v257": ("gpt_125m", ModelShape(6, 384, 6, 256, 257)),
    "gpt_8l_h4096": ("gpt_6.7b", ModelShape(8, 4096, 32, 2048, 50257)),  # gpt_6.7b's width, 8 layers: one GPU
    # context parallelism's long sequences (learned positions: max_position_embeddings follows seq_length)
    "gpt_1.3b_s32k": ("gpt_1.3b", ModelShape(24, 2048, 16, 32768, 50257)),
    "gpt_1.3b_s128k": ("gpt_1.3b", ModelShape(24, 2048, 16, 131072, 50257)),
    # the CPU dry run's stand-ins (`bench/x8.py`): 8 layers and 8 heads, so that every layout of the
    # 8-GPU table (tp 8, pp 8, pp 4 × vpp 2, cp 8: 64 = 2 · 8 · 4 tokens) divides them
    "tiny_x8": ("tiny", ModelShape(8, 64, 8, 64, 1000)),
    "moe_tiny_x8": ("moe_tiny", ModelShape(4, 64, 4, 64, 1000)),
}

# mptrain variants: name -> extra Hydra overrides (each measured change is a variant); an item
# "env:NAME=VALUE" sets an environment variable of the run instead (`variant_env`), an item
# "inductor:KEY=VALUE" a ``torch._inductor.config`` key (mptrain_entry.py's --bench-inductor), an item
# "flag:--NAME=VALUE" one of mptrain_entry.py's own flags (both through `variant_flags`).
VARIANTS = {
    "base": ("model.compile_layers=false",),  # eager: the loss reference of the other variants
    "default": (),  # the plain command a user runs (compiled on CUDA: model.compile_layers=null)
    # the plain command on real indexed data: the shipped corpus, byte tokenizer (an item "data=..." replaces
    # data=mock and its vocab_size; the config's vocabulary must be the tokenizer's, 257)
    "default_real": ("data=shakespeare",),
    "compile": ("model.compile_layers=true",),  # compile_scope=chunk, the default
    "compile_layer": ("model.compile_layers=true", "model.compile_scope=layer"),
    "compile_ro": ("model.compile_layers=true", "model.compile_mode=reduce-overhead"),
    # A/B of train.defer_step_read (on by default on CUDA): every step read at its end
    "compile_sync": ("model.compile_layers=true", "train.defer_step_read=false"),
    # allocator and Inductor knobs (environment only, same math), tried at gpt_1.3b:
    # none is worth a default (bench/reports/2026-12-02-single-gpu-speed.md)
    "compile_expseg": ("model.compile_layers=true", "env:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
    "compile_cdt": ("model.compile_layers=true", "env:TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1"),
    "compile_apt": ("model.compile_layers=true", "env:TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1"),
    "compile_noapt": ("model.compile_layers=true", "env:TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=0"),
    # 2-D tiled reductions: lets Inductor fuse a column sum (a bias grad) with the kernel producing its input
    "default_tiled_red": ("inductor:triton.tile_reductions=true", "inductor:triton.prefer_nd_tiling=true"),
    # LayerNorm weight-grad finalisation: Inductor's mix-order reduction writes [rows / split_size, h] partial
    # sums that a second kernel adds up; larger splits mean fewer partial rows (the heuristic picked 16 at h = 2048)
    "default_mix_split64": ("inductor:triton.mix_order_reduction_split_size=64",),
    "default_mix_autotune": ("inductor:triton.mix_order_reduction_autotune_split_size=true",),
    # Inductor's own heuristics instead of mptrain.layers.inductor_choices (norms as persistent reductions);
    # its own kernel cache, since the choices handler is not part of every torch's cache key
    "default_stock_inductor": ("flag:--bench-inductor-choices=stock", "env:TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_stock"),
    # attention core: SDPA everywhere vs the unfused GEMM-softmax-GEMM core (auto picks unfused for
    # half precision on CUDA with head dim > 256, i.e. the seed model's 512)
    "sdpa": ("model.attention_backend=sdpa",),
    "unfused": ("model.attention_backend=unfused",),
    "unfused_compile": ("model.attention_backend=unfused", "model.compile_layers=true"),
    # A/B of the overlapped input-grad all-reduce of column-parallel layers (on by default)
    "noasync": ("parallel.async_tensor_model_parallel_allreduce=false",),
    "compile_noasync": ("model.compile_layers=true", "parallel.async_tensor_model_parallel_allreduce=false"),
    "unfused_compile_noasync": ("model.attention_backend=unfused", "model.compile_layers=true",
                                "parallel.async_tensor_model_parallel_allreduce=false"),
    # one hardware queue: kernels start in issue order, so the NCCL kernel launched before the
    # weight-grad GEMM gets its SMs first (Megatron asks for this with TP comm overlap)
    # sequence parallelism (Korthikanti et al. 2022): LayerNorm / residual / dropout on s/tp tokens,
    # reduce-scatter + all-gather instead of all-reduce (same bytes), smaller activations
    "compile_sp": ("model.compile_layers=true", "parallel.sequence_parallel=true"),
    "unfused_compile_sp": ("model.attention_backend=unfused", "model.compile_layers=true",
                           "parallel.sequence_parallel=true"),
    # gradient accumulation fusion is on by default: these A/B it off
    "compile_sp_nogaf": ("model.compile_layers=true", "parallel.sequence_parallel=true",
                         "parallel.gradient_accumulation_fusion=false"),
    "unfused_compile_sp_nogaf": ("model.attention_backend=unfused", "model.compile_layers=true",
                                 "parallel.sequence_parallel=true", "parallel.gradient_accumulation_fusion=false"),
    # async TP: Inductor micro-pipeline TP over symmetric memory (parallel.tp_comm_overlap)
    "compile_sp_tpo": ("model.compile_layers=true", "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"),
    "unfused_compile_sp_tpo": ("model.attention_backend=unfused", "model.compile_layers=true",
                               "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"),
    "unfused_compile_sp_tpo_nogaf": ("model.attention_backend=unfused", "model.compile_layers=true",
                                     "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
                                     "parallel.gradient_accumulation_fusion=false"),
    # every GEMM through cuBLASLt (PyTorch's TORCH_BLAS_PREFER_CUBLASLT) instead of cuBLAS
    "unfused_compile_sp_tpo_lt": ("model.attention_backend=unfused", "model.compile_layers=true",
                                  "parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true",
                                  "env:TORCH_BLAS_PREFER_CUBLASLT=1"),
    "compile_cdmc1": ("model.compile_layers=true", "env:CUDA_DEVICE_MAX_CONNECTIONS=1"),
    # precision=fp8 (torchao float8 casts in the block linears; an item "precision=..." replaces the
    # config's precision): tensorwise and rowwise scaling
    "compile_fp8": ("model.compile_layers=true", "precision=fp8"),
    "compile_fp8_rowwise": ("model.compile_layers=true", "precision=fp8", "precision.fp8_recipe=rowwise"),
    "unfused_compile_cdmc1": ("model.attention_backend=unfused", "model.compile_layers=true",
                              "env:CUDA_DEVICE_MAX_CONNECTIONS=1"),
}


# mptrain variant -> the `torch_ceiling.py` variant in the same precision (configs with reference_per_variant)
REFERENCE_VARIANTS = {"compile": "compile_amp", "compile_fp8": "compile_amp_fp8",
                      "compile_fp8_rowwise": "compile_amp_fp8_rowwise"}


def reference_variants(cfg: "BenchConfig") -> list:
    """The `torch_ceiling.py` variants run beside `cfg`: ``compile_amp``, or one per mptrain variant (an MoE preset's
    `torch_moe.py`: ``compile_amp``, fp32 main weights as mptrain's bf16)."""
    if not cfg.reference_per_variant:
        return ["compile_amp"]
    return list(dict.fromkeys(REFERENCE_VARIANTS[v] for v in cfg.variants if v in REFERENCE_VARIANTS))


def variant_precision(cfg: "BenchConfig", variant: str) -> str:
    """The precision a row of `variant` (mptrain's, or a `REFERENCE_VARIANTS` value) ran in: the config's,
    or ``fp8-<recipe>``."""
    items = VARIANTS.get(variant, ())
    precision = next((i.split("=", 1)[1] for i in items if i.startswith("precision=")),
                     "fp8" if "fp8" in variant else cfg.precision)
    if precision != "fp8":
        return precision
    recipe = next((i.split("=", 1)[1] for i in items if i.startswith("precision.fp8_recipe=")),
                  variant.split("fp8_", 1)[1] if "fp8_" in variant else "tensorwise")
    return f"fp8-{recipe}"


def variant_flags(variant: str) -> list:
    """mptrain_entry.py's own flags that variant `variant` sets (``["--bench-inductor", "K=V,..."]``, ...)."""
    flags = []
    for item in VARIANTS[variant]:
        if item.startswith("flag:"):
            flags += item[5:].split("=", 1)
    inductor = [item[9:] for item in VARIANTS[variant] if item.startswith("inductor:")]
    return flags + (["--bench-inductor", ",".join(inductor)] if inductor else [])


def variant_env(variant: str) -> dict:
    """The environment variables variant `variant` sets ({} for most)."""
    return dict(item[4:].split("=", 1) for item in VARIANTS[variant] if item.startswith("env:"))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark config. ``name`` is the row's ``config``; sizes are counts; times in seconds."""

    name: str
    model: str
    gpus: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    precision: str  # bf16 | fp32
    tf32: bool = False
    warmup: int = 3
    iters: int = 10
    timeout_s: int = 150
    variants: tuple = ("base",)
    peer: bool = True
    reference: bool = False  # also run the plain-PyTorch GPT (`bench/peer/torch_ceiling.py`) at this shape
    dropout: float = 0.0  # hidden and attention dropout, on both sides
    recompute: Optional[str] = None  # full (every layer) | selective (the attention core), on both sides
    reference_per_variant: bool = False  # the reference in each variant's precision (`REFERENCE_VARIANTS`)
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved 1F1B, both trainers)
    cp: int = 1  # context parallelism (parallel.context_parallel_size, p2p ring); dp = gpus / (tp × cp × pp)
    ep: int = 1  # expert parallelism (parallel.expert_model_parallel_size)
    overrides: tuple = ()  # further Hydra overrides of mptrain (e.g. a sharding strategy)
    sweep: Optional[str] = None  # configs with the same sweep name run as one `-m` job over `parallel=`
    fit_check: bool = True  # skip when the planner's memory exceeds the GPU's (keys it models only)
    profile: tuple = ()  # variants also run once profiled (a separate run: kernel time by category)
    baseline: Optional[str] = None  # config whose tokens/s/GPU of the same call this row is divided by
    moe_share: bool = False  # also run `bench/moe_share.py` at this MoE shape (routing + permutation time)

    @property
    def shape(self) -> ModelShape:
        return BENCH_SHAPES[self.model][1] if self.model in BENCH_SHAPES else MODEL_SHAPES[self.model]

    @property
    def preset(self) -> str:
        """The conf/model preset `train.py` starts from (the model itself unless bench-only)."""
        return BENCH_SHAPES[self.model][0] if self.model in BENCH_SHAPES else self.model

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.shape.seq_length

    @property
    def layout(self) -> str:
        vpp = f"vpp{self.vpp}" if self.vpp else ""
        cp = f"cp{self.cp}" if self.cp > 1 else ""
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}pp{self.pp}{vpp}{cp}dp{self.dp}{ep}"

    @property
    def precision_label(self) -> str:
        if self.precision == "fp32":
            return "fp32+tf32" if self.tf32 else "fp32 (tf32 off)"
        return self.precision


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the next multiple of divisible_by × tp."""
    return padded_vocab_size(vocab_size, divisible_by, tp)


def model_config(shape: ModelShape) -> ModelConfig:
    """The `ModelConfig` of a bench shape (the preset's other keys at their defaults: GeLU, MHA, f = 4h)."""
    return ModelConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                       num_attention_heads=shape.num_attention_heads, seq_length=shape.seq_length,
                       vocab_size=shape.vocab_size)


def preset_model_config(preset: str, shape: ModelShape) -> ModelConfig:
    """The `ModelConfig` of ``conf/model/<preset>.yaml`` at `shape`'s sizes (every key of the preset: an MoE
    preset's experts, router top-k, SwiGLU and grouped-query attention count in its FLOPs)."""
    from omegaconf import OmegaConf

    yaml = OmegaConf.load(CONF_MODEL / f"{preset}.yaml")
    keys = {k: v for k, v in OmegaConf.to_container(yaml).items() if k != "defaults"}
    keys.update(num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                seq_length=shape.seq_length, vocab_size=shape.vocab_size)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), keys))


def flops_per_iteration(cfg: BenchConfig) -> int:
    """FLOPs of one iteration of `cfg` (`mptrain.layers.params.flops_per_iteration`; exact integer). A plain GPT
    preset counts as `model_config` (GeLU, MHA, f = 4h); an MoE preset with all its keys (active experts)."""
    s = cfg.shape
    m = preset_model_config(cfg.preset, s) if cfg.preset in MOE_PRESETS else model_config(s)
    return model_flops_per_iteration(m, padded_vocab_size=padded_vocab(s.vocab_size, cfg.tp),
                                     tokens_per_iteration=cfg.tokens_per_iteration)


def _validate(cfg: BenchConfig) -> BenchConfig:
    if cfg.gpus % (cfg.tp * cfg.cp * cfg.pp) != 0:
        raise ValueError(f"bench config {cfg.name}: gpus={cfg.gpus} is not a multiple of tp×cp×pp={cfg.tp * cfg.cp * cfg.pp}")
    if cfg.precision not in ("bf16", "fp16", "fp32") or (cfg.tf32 and cfg.precision != "fp32"):
        raise ValueError(f"bench config {cfg.name}: precision={cfg.precision} tf32={cfg.tf32}; use bf16, fp16, or fp32 with/without tf32")
    unknown = set(cfg.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"bench config {cfg.name}: unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    return cfg


def _full(gpus: int) -> list:
    seed = dict(model="seed_2.8b", gpus=2, tp=2, pp=1, micro_batch_size=8, num_microbatches=1)
    configs = [
        # (b) the MFU target: gpt_1.3b bf16 on one GPU, eager and compiled layers
        BenchConfig("b_gpt1.3b_bf16_tp1", "gpt_1.3b", 1, 1, 1, 4, 4, "bf16", warmup=3, iters=8, timeout_s=200,
                    variants=("base", "compile")),
        # (a) the seed model at tp 2: bf16, fp32 with TF32 allowed, fp32 TF32 off (report-only)
        BenchConfig("a_seed_bf16_tp2", precision="bf16", warmup=3, iters=10, timeout_s=150,
                    variants=("base", "compile_sp_tpo"), **seed),
        BenchConfig("c_gpt1.3b_bf16_tp1pp2", "gpt_1.3b", 2, 1, 2, 2, 8, "bf16", warmup=3, iters=8, timeout_s=180,
                    variants=("base", "compile")),
        BenchConfig("a_seed_fp32tf32_tp2", precision="fp32", tf32=True, warmup=2, iters=6, timeout_s=150,
                    variants=("base", "unfused_compile_sp_tpo"), **seed),
        BenchConfig("a_seed_fp32_tp2", precision="fp32", tf32=False, warmup=2, iters=4, timeout_s=170, **seed),
        # (d) only when 4 GPUs are lent
        BenchConfig("d_gpt1.3b_bf16_tp2pp2", "gpt_1.3b", 4, 2, 2, 2, 8, "bf16", warmup=3, iters=8, timeout_s=180),
    ]
    return [c for c in configs if c.gpus <= gpus]


def _quick(gpus: int) -> list:
    configs = [
        BenchConfig("q_gpt125m_bf16_tp1", "gpt_125m", 1, 1, 1, 4, 2, "bf16", warmup=1, iters=2, timeout_s=120,
                    variants=("base", "compile")),
        BenchConfig("q_gpt1.3b_bf16_tp1", "gpt_1.3b", 1, 1, 1, 4, 4, "bf16", warmup=2, iters=2, timeout_s=150),
        BenchConfig("q_gpt125m_bf16_tp2", "gpt_125m", 2, 2, 1, 4, 2, "bf16", warmup=1, iters=2, timeout_s=120),
        BenchConfig("q_gpt125m_bf16_tp1pp2", "gpt_125m", 2, 1, 2, 2, 4, "bf16", warmup=1, iters=2, timeout_s=120),
    ]
    return [c for c in configs if c.gpus <= gpus]


def _small(gpus: int) -> list:
    """The single-GPU table: mptrain (compiled layers) against the compiled plain-PyTorch GPT at each shape,
    both in one call (ratios only within a call). Ordered by priority. Why up to 100 timed iterations at the
    small shapes: mptrain's host runs one step ahead of the device, and the window mean charges it once for
    the final drain, about 1/iters of the window (a training run pays it once in thousands of iterations)."""
    small = dict(gpus=1, tp=1, pp=1, precision="bf16", warmup=3, iters=10, variants=("compile",), peer=False,
                 reference=True)
    configs = [
        # the default command (variant ``default``) of a small character-level model, with and without dropout
        BenchConfig("s_6x384_v65_s256_mb64_do0.2", "gpt_6x384_v65", micro_batch_size=64, num_microbatches=1,
                    timeout_s=150, dropout=0.2, **{**small, "variants": ("default",), "iters": 40}),
        BenchConfig("s_6x384_v65_s256_mb64", "gpt_6x384_v65", micro_batch_size=64, num_microbatches=1,
                    timeout_s=150, **{**small, "variants": ("default",), "iters": 40}),
        BenchConfig("s_gpt124m_s1024_mb12_do0.1", "gpt_124m_s1024", micro_batch_size=12, num_microbatches=1,
                    timeout_s=150, dropout=0.1, **{**small, "variants": ("default",), "iters": 100}),
        BenchConfig("s_gpt11m_s256_mb64", "gpt_11m_s256", micro_batch_size=64, num_microbatches=1, timeout_s=120, **small),
        BenchConfig("s_gpt124m_s1024_mb12", "gpt_124m_s1024", micro_batch_size=12, num_microbatches=1, timeout_s=120,
                    **{**small, "iters": 100}),
        BenchConfig("s_gpt1.3b_mb4x4", "gpt_1.3b", micro_batch_size=4, num_microbatches=4, timeout_s=150,
                    **{**small, "iters": 8}),
        BenchConfig("s_gpt350m_mb8", "gpt_350m", micro_batch_size=8, num_microbatches=1, timeout_s=120,
                    **{**small, "iters": 100}),
        # the default command on the shipped corpus against the same run on mock data (the data path's cost)
        BenchConfig("s_6x384_v257_s256_mb64_do0.2_real", "gpt_6x384_v257", micro_batch_size=64, num_microbatches=1,
                    timeout_s=150, dropout=0.2, **{**small, "variants": ("default", "default_real"), "iters": 40,
                                                   "reference": False}),
        # the largest model one GPU trains: every layer recomputed, micro batch 1
        BenchConfig("s_gpt6.7b_full_mb1x16", "gpt_6.7b", micro_batch_size=1, num_microbatches=16, timeout_s=300,
                    recompute="full", **{**small, "variants": ("default",), "iters": 6, "warmup": 2,
                                         "reference": False}),
        # the 60 % MFU target's other batch splits of the same global batch (16 × 2048 tokens)
        BenchConfig("s_gpt1.3b_mb8x2", "gpt_1.3b", micro_batch_size=8, num_microbatches=2, timeout_s=150,
                    **{**small, "iters": 8, "reference": False}),
        BenchConfig("s_gpt1.3b_mb16x1", "gpt_1.3b", micro_batch_size=16, num_microbatches=1, timeout_s=150,
                    **{**small, "iters": 8, "reference": False}),
        # a larger global batch (64 × 2048 tokens; GPT-3's 1.3B trained at 1M-token batches): the step's
        # optimizer work amortised over 4 micro-batches of the fastest split
        BenchConfig("s_gpt1.3b_mb16x4", "gpt_1.3b", micro_batch_size=16, num_microbatches=4, timeout_s=180,
                    **{**small, "iters": 6, "reference": False}),
    ]
    return [c for c in configs if c.gpus <= gpus]


def _fp8(gpus: int) -> list:
    """precision=fp8 against bf16 and against torchao's conversion of the plain-PyTorch GPT, both shapes and
    recipes; each mptrain variant runs right before the reference in its precision. Split a call with
    ``--only`` / ``--variants`` (each run compiles for about a minute)."""
    fp8 = dict(gpus=1, tp=1, pp=1, precision="bf16", warmup=3, iters=8, timeout_s=200, peer=False, reference=True,
               reference_per_variant=True, variants=("compile", "compile_fp8", "compile_fp8_rowwise"))
    configs = [
        BenchConfig("f_gpt1.3b_mb4x4", "gpt_1.3b", micro_batch_size=4, num_microbatches=4, **fp8),
        BenchConfig("f_8l_h4096_mb2x4", "gpt_8l_h4096", micro_batch_size=2, num_microbatches=4, **fp8),
    ]
    return [c for c in configs if c.gpus <= gpus]


# ZeRO stages and HSDP as mptrain's keys (Megatron's names); ZeRO-1 is the distributed optimizer
SHARDING = {
    "ddp": (),
    "zero1": ("parallel.use_distributed_optimizer=true",),
    "zero2": ("parallel.data_parallel_sharding_strategy=optim_grads",),
    "zero3": ("parallel.data_parallel_sharding_strategy=optim_grads_params",),
    "hsdp2x4": ("parallel.data_parallel_sharding_strategy=optim_grads_params", "parallel.data_parallel_shard_size=4"),
}
PLANNED_SHARDING = ("ddp", "zero1", "zero2", "zero3", "hsdp2x4")  # `mptrain.planner` models them: its memory decides a skip


def _zero(gpus: int) -> list:
    """Sharded data parallelism on one GPU (variant ``default``, bf16; each row divided by its ``baseline`` of the
    same call, `vs_baseline`):

    * every strategy at dp = 1 against no_shard at gpt_1.3b: nothing to shard, nothing to pay (ZeRO-2 / ZeRO-3
      run as no_shard at dp = 1, ZeRO-1 as a distributed optimizer over one rank): each ≥ 0.98 × the DDP row;
    * ZeRO-3 + full recompute with ``optim.optimizer_cpu_offload`` (FSDP2 keeps the one rank's fp32 shards, their
      grads and Adam's state in host memory, 16 bytes a param; the device holds two layers' bf16 params, the
      recomputed activations, the logits and, with four micro-batches a step, the fp32 grads accumulated unsharded
      until the step's one reduction) against the same without offload (at dp = 1 the DDP path: 18 bytes a
      param on the device), at gpt_2.7b (both fit an H100: the price of offload) and gpt_6.7b, the largest GPT
      preset whose host states fit the machine's 128 GiB (gpt_13b needs 208 GB); without offload it needs 120 GiB
      of device memory: the planner skips it on an 80 GiB GPU."""
    one = dict(gpus=1, tp=1, pp=1, precision="bf16", variants=("default",), peer=False)
    rows = [BenchConfig(f"z_gpt1.3b_mb4x4_{s}", "gpt_1.3b", micro_batch_size=4, num_microbatches=4, warmup=3, iters=8,
                        timeout_s=200, overrides=SHARDING[s], baseline=None if s == "ddp" else "z_gpt1.3b_mb4x4_ddp",
                        **one)
            for s in ("ddp", "zero1", "zero2", "zero3")]
    offload = SHARDING["zero3"] + ("optim.optimizer_cpu_offload=true",)
    for model, short in (("gpt_2.7b", "gpt2.7b"), ("gpt_6.7b", "gpt6.7b")):
        # 4 micro-batches: each gathers every layer twice from host memory (ZeRO-3 over one rank)
        big = dict(model=model, micro_batch_size=1, num_microbatches=4, recompute="full", warmup=1, iters=3,
                   timeout_s=420, **one)
        rows += [BenchConfig(f"z_{short}_zero3_full_mb1x4", overrides=SHARDING["zero3"], **big),
                 BenchConfig(f"z_{short}_zero3_full_offload_mb1x4", overrides=offload,
                             baseline=f"z_{short}_zero3_full_mb1x4", **big)]
    return [c for c in rows if c.gpus <= gpus]


def _x8(gpus: int) -> list:
    """The 8-GPU table, in the order of its calls (`bench/x8.py` splits it): every row runs the plain command
    (variant ``default``: compiled on CUDA), bf16 unless the row says otherwise, megatron-core beside the rows
    whose layout it has (its local layer spec: no SP, no CP, no ZeRO-2/3, no MoE here)."""
    d = dict(variants=("default",), peer=False)
    rows = [
        # the design's command: 50 iterations, fp16 with the dynamic loss scaler (skips only at the start)
        BenchConfig("x8_seed_fp16_tp2pp4", "seed_2.8b", 8, 2, 4, 4, 16, "fp16", warmup=5, iters=45, **d),
    ]
    # the design's layout sweep, one `-m` job over parallel= (dp 1 everywhere: one global batch of 32)
    rows += [BenchConfig(f"x8_gpt1.3b_tp{tp}pp{pp}", "gpt_1.3b", 8, tp, pp, 2, 16, "bf16", warmup=3, iters=8,
                         sweep="layouts", **{**d, "peer": True})
             for tp, pp in ((1, 8), (2, 4), (4, 2), (8, 1))]
    # interleaved 1F1B at gpt_6.7b against megatron-core's interleaved schedule
    rows += [BenchConfig(f"x8_gpt6.7b_tp{tp}pp{pp}vpp2", "gpt_6.7b", 8, tp, pp, 1, 16, "bf16", warmup=3, iters=6,
                         vpp=2, **{**d, "peer": True})
             for tp, pp in ((2, 4), (4, 2))]
    # weak scaling: the same micro-batches per GPU on 1, 2, 4, 8 GPUs; ZeRO-n equals DDP on one GPU; each row
    # divided by the one-GPU DDP row of its own call (efficiency)
    for model, short, mbs, m, recompute, warmup, iters in (("gpt_1.3b", "gpt1.3b", 4, 4, None, 3, 8),
                                                           ("gpt_6.7b", "gpt6.7b", 1, 16, "full", 2, 4)):
        for n in (1, 2, 4, 8):
            for sharding in ("ddp", "zero1", "zero2", "zero3") if n > 1 else ("ddp",):
                rows.append(BenchConfig(f"x8_{short}_n{n}_{sharding}", model, n, 1, 1, mbs, m, "bf16", warmup=warmup,
                                        iters=iters, recompute=recompute, overrides=SHARDING[sharding],
                                        fit_check=sharding in PLANNED_SHARDING,
                                        baseline=None if n == 1 else f"x8_{short}_n1_ddp", **d))
        rows.append(BenchConfig(f"x8_{short}_n8_hsdp2x4", model, 8, 1, 1, mbs, m, "bf16", warmup=warmup, iters=iters,
                                recompute=recompute, overrides=SHARDING["hsdp2x4"],
                                baseline=f"x8_{short}_n1_ddp", **d))
    # context parallelism: one sequence per step on cp GPUs (dp 1); 128k recomputes every layer to fit
    for model, recompute in (("gpt_1.3b_s32k", None), ("gpt_1.3b_s128k", "full")):
        rows += [BenchConfig(f"x8_{model.split('_')[-1]}_cp{cp}", model, cp, 1, 1, 1, 1, "bf16", warmup=2, iters=4,
                             cp=cp, recompute=recompute, fit_check=False, **d)
                 for cp in (2, 4, 8)]
    # expert parallelism (MoE bench model): ep 1 (every rank all 8 experts), ep 8, tp 2 (SP) × ep 4; each
    # also profiled (a separate run) for the all-to-all share of the step
    moe = dict(gpus=8, pp=1, micro_batch_size=4, num_microbatches=2, precision="bf16", warmup=3, iters=8,
               profile=("default",), **d)
    rows += [
        BenchConfig("x8_moe_ep1", "moe_mixtral_small", tp=1, **moe),
        BenchConfig("x8_moe_ep8", "moe_mixtral_small", tp=1, ep=8, baseline="x8_moe_ep1", **moe),
        BenchConfig("x8_moe_tp2ep4", "moe_mixtral_small", tp=2, ep=4, overrides=("parallel.sequence_parallel=true",),
                    baseline="x8_moe_ep1", **moe),
    ]
    return [c for c in rows if c.gpus <= gpus]


def _moe(gpus: int) -> list:
    """One GPU, one call: mptrain's default command at ``moe_mixtral_small`` (8 micro-batches of 4 × 2048 tokens)
    beside the compiled plain-PyTorch MoE GPT of the same shape and routing, the layer's routing and permutation
    time (`bench/moe_share.py`), and gpt_1.3b's default command beside the plain-PyTorch GPT (the dense path)."""
    one = dict(gpus=1, tp=1, pp=1, precision="bf16", peer=False, reference=True, variants=("default",), warmup=3)
    configs = [
        BenchConfig("m_moe_mixtral_small_mb4x8", "moe_mixtral_small", micro_batch_size=4, num_microbatches=8,
                    iters=6, timeout_s=150, moe_share=True, **one),
        BenchConfig("m_gpt1.3b_mb4x4", "gpt_1.3b", micro_batch_size=4, num_microbatches=4, iters=6, timeout_s=150,
                    **one),
    ]
    return [c for c in configs if c.gpus <= gpus]


SUITES = {"full": _full, "quick": _quick, "ceiling": lambda gpus: [], "small": _small, "fp8": _fp8, "x8": _x8,
          "zero": _zero, "moe": _moe}


def suite(name: str, gpus: int, only: Optional[list] = None) -> list:
    """The configs of suite `name` that fit on `gpus` GPUs (optionally only those named in `only`).

    Raises:
        ValueError: unknown suite, or a name in `only` that the suite does not have.
    """
    try:
        configs = [_validate(c) for c in SUITES[name](gpus)]
    except KeyError:
        raise ValueError(f"--suite {name!r} is not one of {sorted(SUITES)}") from None
    if only:
        known = {c.name for c in SUITES[name](8)}
        missing = set(only) - known
        if missing:
            raise ValueError(f"--only {sorted(missing)}: not in suite {name!r} ({sorted(known)})")
        configs = [c for c in configs if c.name in only]
    return configs


def mptrain_overrides(cfg: BenchConfig, variant: str, run_dir: str) -> list:
    """Hydra overrides that make `train.py` run `cfg` like the peer: mock data and the model at the shape's vocab,
    AdamW(lr 1e-4, wd 0.01), clip 1.0, dropout 0, no evaluation, no checkpoints."""
    s = cfg.shape
    # a variant's "precision=..." replaces the config's (one group override per command line)
    precision = next((i for i in VARIANTS[variant] if i.startswith("precision=")), f"precision={cfg.precision}")
    data = next((i for i in VARIANTS[variant] if i.startswith("data=")), None)
    o = [
        f"model={cfg.preset}",
        f"parallel=tp{cfg.tp}pp{cfg.pp}",
        precision,
        *([data] if data else ["data=mock", f"data.vocab_size={s.vocab_size}"]),
        f"model.vocab_size={s.vocab_size}",  # the model's own output layer too, not the preset's vocab
        "optim=adamw",
        "optim.lr=1e-4",
        "optim.weight_decay=0.01",
        "train.clip_grad=1.0",
        f"train.micro_batch_size={cfg.micro_batch_size}",
        f"train.global_batch_size={cfg.global_batch_size}",
        f"train.train_iters={cfg.warmup + cfg.iters}",
        "train.eval_interval=null",
        f"model.hidden_dropout={cfg.dropout}",
        f"model.attention_dropout={cfg.dropout}",
        "run.progress_bar=false",
        f"run.dir={run_dir}",
    ]
    if cfg.model in BENCH_SHAPES:
        o += [f"model.num_layers={s.num_layers}", f"model.hidden_size={s.hidden_size}",
              f"model.num_attention_heads={s.num_attention_heads}", f"model.seq_length={s.seq_length}"]
    if cfg.precision == "fp32":
        o.append(f"precision.allow_tf32={'true' if cfg.tf32 else 'false'}")
    if cfg.pp > 1:
        o.append("schedule=interleaved_1f1b" if cfg.vpp else "schedule=1f1b")
    if cfg.vpp:
        o.append(f"parallel.virtual_pipeline_model_parallel_size={cfg.vpp}")
    if cfg.cp > 1:
        o += [f"parallel.context_parallel_size={cfg.cp}", "parallel.cp_comm_type=p2p"]
    if cfg.ep > 1:
        o.append(f"parallel.expert_model_parallel_size={cfg.ep}")
    o += list(cfg.overrides)
    if cfg.recompute == "full":
        o += ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
    elif cfg.recompute is not None:
        o.append(f"model.recompute_granularity={cfg.recompute}")
    return o + [item for item in VARIANTS[variant] if not item.startswith(("env:", "inductor:", "flag:", "precision=", "data="))]


def reference_env(cfg: BenchConfig) -> dict:
    """Environment of `bench/peer/torch_ceiling.py` for `cfg`'s shape, batch, dropout and recomputation (AdamW,
    clip 1.0 as mptrain; the vocabulary padded as mptrain pads it, so both count the same FLOPs)."""
    s = cfg.shape
    return {"LAYERS": str(s.num_layers), "HIDDEN": str(s.hidden_size), "HEADS": str(s.num_attention_heads),
            "SEQ": str(s.seq_length), "MBS": str(cfg.micro_batch_size), "M": str(cfg.num_microbatches),
            "CLIP": "1.0", "ITERS": str(cfg.iters), "WARMUP": str(cfg.warmup),
            "VOCAB": str(s.vocab_size), "VOCAB_PADDED": str(padded_vocab(s.vocab_size, cfg.tp)),
            "DROPOUT": str(cfg.dropout), "RECOMPUTE": cfg.recompute or ""}


def moe_reference_env(cfg: BenchConfig) -> dict:
    """Environment of `bench/peer/torch_moe.py` for an MoE preset's `cfg`: its shape, experts, top-k, expert width
    and aux-loss coefficient from the whole preset, mptrain's batch, AdamW with clip 1.0."""
    s = cfg.shape
    m = preset_model_config(cfg.preset, s)
    return {"LAYERS": str(s.num_layers), "HIDDEN": str(s.hidden_size), "HEADS": str(s.num_attention_heads),
            "QUERY_GROUPS": str(m.num_query_groups or s.num_attention_heads), "SEQ": str(s.seq_length),
            "EXPERT_FFN": str(m.moe_ffn_hidden_size or m.ffn_hidden_size), "EXPERTS": str(m.num_moe_experts),
            "TOPK": str(m.moe_router_topk), "AUX_COEFF": str(m.moe_aux_loss_coeff),
            "MBS": str(cfg.micro_batch_size), "M": str(cfg.num_microbatches), "CLIP": "1.0", "ITERS": str(cfg.iters),
            "WARMUP": str(cfg.warmup), "VOCAB": str(s.vocab_size), "VOCAB_PADDED": str(padded_vocab(s.vocab_size, cfg.tp))}


def peer_args(cfg: BenchConfig, out_file: str) -> list:
    """Arguments of `bench/peer/peer_megatron.py` for `cfg` (its defaults: tied embeddings, fusions on,
    dropout 0, Megatron Adam with weight decay 0.01, clip 1.0)."""
    s = cfg.shape
    a = [
        "--name", cfg.name, "--tp", str(cfg.tp), "--pp", str(cfg.pp),
        "--num-layers", str(s.num_layers), "--hidden-size", str(s.hidden_size),
        "--num-heads", str(s.num_attention_heads), "--seq-length", str(s.seq_length),
        "--vocab-size", str(s.vocab_size),
        "--micro-batch-size", str(cfg.micro_batch_size), "--num-microbatches", str(cfg.num_microbatches),
        "--dtype", cfg.precision, "--warmup", str(cfg.warmup), "--iters", str(cfg.iters),
        "--out", out_file,
    ]
    if cfg.tf32:
        a.append("--tf32")
    if cfg.vpp:
        a += ["--vpp", str(cfg.vpp)]
    return a
