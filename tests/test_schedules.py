"""Pipeline schedules on a toy chunk model: every schedule equals a single-process reference.

Toy model (same contract as GPTModel chunks): the first virtual stage embeds token ids
``[b, s] -> [s, b, h]``, every stage applies its global layers ``x = tanh(W_i x + c_i)``, the last
stage projects to the vocabulary and returns the per-token cross entropy ``[b, s]``. Each weight
is generated from a generator seeded by its global identity, so the full model is the same for
every pipeline split. The reference runs the full model on the whole global batch in one process
with the global-token-mean loss; the schedule's grads are rescaled by ``max_tokens / num_tokens``
as finalize_model_grads does.
"""

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.groups import build_groups
from mptrain.schedules import PipelineLayout, ScheduleStats, resolve_schedule, select_for_layout
from schedule_utils import make_spec, schedule_fn

VOCAB, HIDDEN, SEQ, MBS = 37, 16, 8, 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class ToyChunk(torch.nn.Module):
    """One virtual stage: optional embedding, global layers ``layer_ids``, optional head + per-token loss."""

    def __init__(self, layer_ids, *, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None
        if pre_process:
            self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
            self.embed.weight.data = torch.randn(VOCAB, HIDDEN, generator=_gen(1))
        self.layers = torch.nn.ModuleDict()
        for i in layer_ids:
            lin = torch.nn.Linear(HIDDEN, HIDDEN)
            lin.weight.data = torch.randn(HIDDEN, HIDDEN, generator=_gen(100 + i)) / HIDDEN**0.5
            lin.bias.data = torch.randn(HIDDEN, generator=_gen(200 + i)) * 0.1
            self.layers[str(i)] = lin
        if post_process:
            self.head = torch.nn.Linear(HIDDEN, VOCAB)
            self.head.weight.data = torch.randn(VOCAB, HIDDEN, generator=_gen(2)) / HIDDEN**0.5
            self.head.bias.data = torch.zeros(VOCAB)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, tokens, labels):
        # x: [s, b, h]
        x = self.embed(tokens).transpose(0, 1) if self.pre_process else self.input_tensor
        for lin in self.layers.values():
            x = torch.tanh(lin(x))
        if not self.post_process:
            return x
        logits = self.head(x)  # [s, b, V]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1), reduction="none")
        return loss.view(SEQ, -1).t()  # per-token loss [b, s]


def stage_sizes(num_layers, num_stages, first=None, last=None):
    """Layers per virtual stage: even, or with the first / last stage given (the rest split evenly)."""
    sizes = [None] * num_stages
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    rest = num_layers - sum(s for s in sizes if s is not None)
    free = [i for i, s in enumerate(sizes) if s is None]
    assert rest % len(free) == 0
    for i in free:
        sizes[i] = rest // len(free)
    return sizes


def build_chunks(rank_pp, pp, vpp, sizes):
    chunks = []
    starts = [sum(sizes[:v]) for v in range(len(sizes))]
    for c in range(vpp):
        v = c * pp + rank_pp  # virtual stage of chunk c on this rank
        ids = list(range(starts[v], starts[v] + sizes[v]))
        chunks.append(ToyChunk(ids, pre_process=v == 0, post_process=v == pp * vpp - 1))
    return chunks


def make_batches(m, seed=7):
    g = _gen(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) < 0.7).float()  # ~30 % masked: token mean != mb mean
        out.append({"tokens": tokens, "labels": labels, "loss_mask": loss_mask})
    return out


def forward_step(data_iterator, chunk):
    batch = next(data_iterator)  # every chunk consumes its own iterator in micro-batch order
    out = chunk(batch["tokens"], batch["labels"])

    def loss_func(per_token):
        loss_sum = (per_token * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum()
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach(), "num_tokens": num_tokens.detach()}

    return out, loss_func


def reference(batches, num_layers):
    """Full model, whole global batch, one process: loss and grads of the global token-mean loss."""
    model = ToyChunk(range(num_layers), pre_process=True, post_process=True)
    tokens = torch.cat([b["tokens"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    mask = torch.cat([b["loss_mask"] for b in batches])
    model_out = model(tokens, labels)
    loss = (model_out * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, mask.sum()


def assert_grads_match(chunks, ref_grads, scale):
    seen = 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            ref = ref_grads[name]
            # fp32, different summation order (per micro-batch accumulation vs one batch):
            # rel 1e-5 of the tensor's largest entry (required: rel 1e-5)
            torch.testing.assert_close(p.grad * scale, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            seen += 1
    return seen


def _run_schedule(rank, world, schedule, pp, vpp, m, sizes_kw, loss_scale=1.0):
    groups = build_groups(1, pp, vpp)
    try:
        nstages = pp * (vpp or 1)
        sizes = stage_sizes(**sizes_kw, num_stages=nstages)
        num_layers = sum(sizes)
        chunks = build_chunks(groups.pp_rank, pp, vpp or 1, sizes)
        batches = make_batches(m)
        iters = [iter(batches) for _ in chunks]
        fn = schedule_fn(schedule)
        stats = ScheduleStats()
        max_tokens = m * MBS * SEQ
        spec = make_spec(groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                         max_tokens=max_tokens)
        reports, num_tokens = fn(
            spec, forward_step_func=forward_step, data_iterator=iters if vpp else iters[0], model=chunks,
            stats=stats, loss_scale=loss_scale,
        )
        ref_loss, ref_grads, ref_tokens = reference(batches, num_layers)
        # finalize_model_grads' rescale: grads were of Σ loss_sum / max_tokens
        seen = assert_grads_match(chunks, ref_grads, max_tokens / ref_tokens.item() / loss_scale)
        loss = None
        if groups.is_last_stage:
            assert len(reports) == m
            assert int(num_tokens) == int(ref_tokens.item())
            loss = sum(r["loss_sum"] for r in reports) / sum(r["num_tokens"] for r in reports)
            # fp32 sums in a different order: rel 1e-5 (required)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        else:
            assert reports == [] and int(num_tokens) == 0
        return {"params": seen, "inflight": stats.max_inflight_microbatches, "bytes": stats.bytes_sent["pp"],
                "loss": loss}
    finally:
        groups.destroy()


EVEN = {"num_layers": 8}


@pytest.mark.parametrize("schedule", ["no_pipelining", "gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 3])
def test_pp1(schedule, m):
    out = run_distributed(_run_schedule, 1, schedule, 1, None, m, EVEN)
    assert out[0]["params"] == 1 + 16 + 2 and out[0]["bytes"] == 0
    assert out[0]["inflight"] == (m if schedule == "gpipe" else 1)  # GPipe holds every micro-batch even at pp 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_pp2(schedule, m):
    out = run_distributed(_run_schedule, 2, schedule, 2, None, m, EVEN)
    assert sum(o["params"] for o in out) == 19  # every parameter was compared once
    expected = [m, m] if schedule == "gpipe" else [min(2 - r, m) for r in range(2)]
    assert [o["inflight"] for o in out] == expected
    act = SEQ * MBS * HIDDEN * 4  # bytes of one [s, b, h] fp32 activation
    assert [o["bytes"] for o in out] == [m * act, m * act]  # stage 0 sends activations, stage 1 grads


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_pp4(schedule, m):
    out = run_distributed(_run_schedule, 4, schedule, 4, None, m, EVEN)
    assert sum(o["params"] for o in out) == 19
    expected = [m] * 4 if schedule == "gpipe" else [min(4 - r, m) for r in range(4)]
    assert [o["inflight"] for o in out] == expected


@pytest.mark.parametrize("m", [2, 4, 8])
def test_interleaved_pp2_vpp2(m):
    out = run_distributed(_run_schedule, 2, "interleaved_1f1b", 2, 2, m, EVEN)
    assert sum(o["params"] for o in out) == 19


@pytest.mark.parametrize("m", [4, 8])
def test_interleaved_pp4_vpp2(m):
    out = run_distributed(_run_schedule, 4, "interleaved_1f1b", 4, 2, m, EVEN)
    assert sum(o["params"] for o in out) == 19


@pytest.mark.parametrize("schedule, vpp", [("1f1b", None), ("interleaved_1f1b", 2)])
def test_loss_scale_scales_grads_only(schedule, vpp):
    # fp16 loss scaling: grads are of loss_scale · Σ loss_sum / max_tokens; the reported loss is unscaled
    out = run_distributed(_run_schedule, 2, schedule, 2, vpp, 4, EVEN, 1024.0)
    assert sum(o["params"] for o in out) == 19


def test_interleaved_pp2_vpp3():
    out = run_distributed(_run_schedule, 2, "interleaved_1f1b", 2, 3, 4, {"num_layers": 6})
    assert sum(o["params"] for o in out) == 6 * 2 + 3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_split_pp4(schedule):
    # decoder_first/last_pipeline_num_layers = 1 / 1 with 8 layers: stages hold 1, 3, 3, 1 layers
    out = run_distributed(_run_schedule, 4, schedule, 4, None, 3, {"num_layers": 8, "first": 1, "last": 1})
    assert sum(o["params"] for o in out) == 19


def test_interleaved_uneven_split():
    out = run_distributed(_run_schedule, 2, "interleaved_1f1b", 2, 2, 4, {"num_layers": 8, "first": 1, "last": 3})
    assert sum(o["params"] for o in out) == 19


# --- selection and rejection ----------------------------------------------------------------------------------

def _layout(pp, vpp, m=4, dp=1):
    return PipelineLayout(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp, data_parallel_size=dp, num_microbatches=m,
                          micro_batch_size=MBS)


def _node(option, **extra):
    return {"name": option, "_target_": schedule_fn(option).__module__ + "." + schedule_fn(option).__qualname__,
            **extra}


def test_auto_and_layout_rules():
    table = [((1, None), "no_pipelining"), ((2, None), "1f1b"), ((4, None), "1f1b"), ((2, 2), "interleaved_1f1b")]
    for (pp, vpp), name in table:
        assert resolve_schedule(_node("auto"), _layout(pp, vpp)).name == name
        assert select_for_layout(_layout(pp, vpp)) is schedule_fn(name)
    assert resolve_schedule(_node("gpipe"), _layout(2, None)).fn is schedule_fn("gpipe")
    assert resolve_schedule(_node("gpipe"), _layout(1, None)).name == "no_pipelining"  # one stage degenerates
    bad = [
        ("no_pipelining", 2, None, 4, "schedule=no_pipelining cannot run pipeline_model_parallel_size=2"),
        ("interleaved_1f1b", 2, None, 4, "virtual_pipeline_model_parallel_size is null but schedule=interleaved_1f1b"),
        ("1f1b", 2, 2, 4, "virtual_pipeline_model_parallel_size=2 needs schedule=interleaved_1f1b or auto (got schedule=1f1b)"),
        ("gpipe", 4, 2, 4, "virtual_pipeline_model_parallel_size=2 needs schedule=interleaved_1f1b or auto (got schedule=gpipe)"),
        ("auto", 4, 2, 6, "needs num_microbatches % pipeline_model_parallel_size == 0, got 6"),
    ]
    for name, pp, vpp, m, msg in bad:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
            resolve_schedule(_node(name), _layout(pp, vpp, m))
        assert "\n" not in str(e.value)


def _rejected(rank, world, schedule, pp, vpp, m):
    groups = build_groups(1, pp, vpp)
    try:
        chunks = build_chunks(groups.pp_rank, pp, vpp or 1, stage_sizes(8, pp * (vpp or 1)))
        fn = schedule_fn(schedule)
        iters = [iter(make_batches(max(m, 1))) for _ in chunks]
        try:
            spec = make_spec(groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                             max_tokens=max(m, 1) * MBS * SEQ)
            fn(spec, forward_step_func=forward_step, data_iterator=iters if vpp else iters[0], model=chunks)
        except ConfigError as e:
            return str(e)
        return None
    finally:
        groups.destroy()


@pytest.mark.parametrize("world, pp, m", [(2, 2, 1), (2, 2, 3), (4, 4, 1), (4, 4, 2), (4, 4, 3), (4, 4, 6)])
def test_interleaved_rejects_microbatch_counts(world, pp, m):
    msgs = run_distributed(_rejected, world, "interleaved_1f1b", pp, 2, m, timeout_s=60)
    # the one copy of the rule (interleaved's check_layout; validate_config raises the same line at start-up)
    expected = (f"schedule=interleaved_1f1b needs num_microbatches % pipeline_model_parallel_size == 0, got {m} "
                f"micro-batches (train.global_batch_size={m * MBS} / (micro_batch_size {MBS} × dp 1)) and pp={pp}; "
                f"make global_batch_size a multiple of {MBS * pp}")
    assert msgs == [expected] * world  # every rank, before any communication: no hang


@pytest.mark.parametrize("schedule, vpp", [("1f1b", None), ("gpipe", None), ("interleaved_1f1b", 2)])
def test_zero_microbatches_rejected(schedule, vpp):
    msgs = run_distributed(_rejected, 2, schedule, 2, vpp, 0, timeout_s=60)
    assert all(msg is not None and "num_microbatches=0 must be an int >= 1" in msg for msg in msgs), msgs


# --- forward only (evaluation) ----------------------------------------------------------------------------------

def _forward_only(rank, world, schedule, pp, vpp, m):
    groups = build_groups(1, pp, vpp)
    try:
        sizes = stage_sizes(8, pp * (vpp or 1))
        chunks = build_chunks(groups.pp_rank, pp, vpp or 1, sizes)
        batches = make_batches(m)
        iters = [iter(batches) for _ in chunks]
        stats = ScheduleStats()
        spec = make_spec(groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                         max_tokens=None)
        reports, num_tokens = schedule_fn(schedule)(
            spec, forward_step_func=forward_step, data_iterator=iters if vpp else iters[0], model=chunks,
            forward_only=True, stats=stats)
        assert all(p.grad is None for c in chunks for p in c.parameters())
        assert stats == ScheduleStats()  # evaluation does not count toward per-iteration stats
        if not groups.is_last_stage:
            return None
        ref_loss, _, ref_tokens = reference(batches, 8)
        assert int(num_tokens) == int(ref_tokens.item())
        loss = sum(r["loss_sum"] for r in reports) / sum(r["num_tokens"] for r in reports)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)  # fp32, other summation order
        return float(loss)
    finally:
        groups.destroy()


@pytest.mark.parametrize("schedule, world, vpp, m", [("no_pipelining", 1, None, 3), ("gpipe", 2, None, 3),
                                                     ("1f1b", 4, None, 3), ("interleaved_1f1b", 2, 2, 4)])
def test_forward_only(schedule, world, vpp, m):
    out = run_distributed(_forward_only, world, schedule, world, vpp, m)
    assert out[-1] is not None


# --- DP grad sync only on the last backward of each chunk -------------------------------------------------------

class _SyncFlag:
    """A stand-in for DDP.no_sync: while entered, grad sync is off."""

    def __init__(self):
        self.enabled = True

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.enabled = False
            try:
                yield
            finally:
                self.enabled = True

        return ctx()


def _no_sync(rank, world, schedule, pp, vpp, m):
    groups = build_groups(1, pp, vpp)
    try:
        chunks = build_chunks(groups.pp_rank, pp, vpp or 1, stage_sizes(8, pp * (vpp or 1)))
        flags = [_SyncFlag() for _ in chunks]
        log = []
        for c, chunk in enumerate(chunks):
            p = next(iter(chunk.layers.values())).weight  # one param per chunk: its grad hook fires once per backward
            p.register_hook(lambda g, c=c: log.append((c, flags[c].enabled)))
        iters = [iter(make_batches(m)) for _ in chunks]
        no_sync_func = [f.no_sync for f in flags] if vpp else flags[0].no_sync
        spec = make_spec(groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                         max_tokens=m * MBS * SEQ)
        schedule_fn(schedule)(spec, forward_step_func=forward_step, data_iterator=iters if vpp else iters[0],
                              model=chunks, no_sync_func=no_sync_func)
        return [[enabled for cc, enabled in log if cc == c] for c in range(len(chunks))]
    finally:
        groups.destroy()


@pytest.mark.parametrize("schedule, world, vpp, m", [("no_pipelining", 1, None, 3), ("gpipe", 2, None, 3),
                                                     ("1f1b", 4, None, 3), ("1f1b", 2, None, 1),
                                                     ("interleaved_1f1b", 2, 2, 4)])
def test_grad_sync_only_on_last_backward(schedule, world, vpp, m):
    for per_chunk in run_distributed(_no_sync, world, schedule, world, vpp, m):
        assert per_chunk == [[False] * (m - 1) + [True]] * (vpp or 1)


# --- stored activations: 1F1B's bound vs GPipe's -----------------------------------------------------------------

class _SavedBytes:
    """saved_tensors_hooks that track the bytes autograd currently holds for backward, and their peak."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def pack(self, t):
        meter = self

        class Holder:
            def __init__(self):
                self.t = t
                meter.current += t.numel() * t.element_size()
                meter.peak = max(meter.peak, meter.current)

            def __del__(self):
                meter.current -= self.t.numel() * self.t.element_size()

        return Holder()

    @staticmethod
    def unpack(holder):
        return holder.t


def _saved_activations(rank, world, m):
    groups = build_groups(1, world)
    try:
        out = {}
        for schedule, mb in (("1f1b", 1), ("1f1b", m), ("gpipe", m)):
            chunks = build_chunks(groups.pp_rank, world, 1, stage_sizes(8, world))
            meter, stats = _SavedBytes(), ScheduleStats()
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                spec = make_spec(groups, num_microbatches=mb, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                                 max_tokens=mb * MBS * SEQ)
                schedule_fn(schedule)(spec, forward_step_func=forward_step, data_iterator=iter(make_batches(mb)),
                                      model=chunks, stats=stats)
            assert meter.current == 0  # everything saved was freed by the backwards
            out[(schedule, mb)] = (meter.peak, stats.max_inflight_microbatches)
        return out
    finally:
        groups.destroy()


def test_stored_activations_1f1b_vs_gpipe_pp4():
    m, pp = 8, 4
    for stage, out in enumerate(run_distributed(_saved_activations, pp, m)):
        one_mb = out[("1f1b", 1)][0]  # bytes autograd saves for one micro-batch on this stage
        assert one_mb > 0
        bound = min(pp - stage, m)
        assert out[("1f1b", m)] == (bound * one_mb, bound), (stage, out)  # exact: shapes are static
        assert out[("gpipe", m)] == (m * one_mb, m), (stage, out)
