"""torch.distributed initialisation and the TP / CP / PP / DP / MP / embedding process groups.

Rank layout (Megatron's order "tp-cp-dp-pp": TP varies fastest, then CP, then DP, then PP)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))   i.e. arange(world).view(pp, dp, cp, tp)

With context_parallel_size = 1 (the default) this is Megatron's "tp-dp-pp" grid ``view(pp, dp, tp)``.

Worked example (Megatron ``parallel_state.py``; checked by ``tests/test_groups.py``):
16 GPUs, tensor_model_parallel_size=2, pipeline_model_parallel_size=4 => data-parallel size 2::

    grid[pp][dp][tp] = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14, 15]]]
    TP  [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]            (last axis)
    DP  [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]            (middle axis)
    PP  [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]                    (first axis)
    MP  [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]                        (tp x pp, one dp index)
    embedding [0,12] [1,13] [2,14] [3,15]                                (first + last of each PP group)

TP groups are contiguous ranks (one node, NVLink); PP is the outermost axis (across nodes).

Context parallelism (Megatron-core ``parallel_state.py``; checked by ``tests/test_groups.py``): the CP
ranks of one group hold slices of the same sequences and replicate every weight, so weight grads (and
ZeRO-1's shards) span the data-parallel-with-context group DP × CP (Megatron's
``get_data_parallel_group(with_context_parallel=True)``). Worked example, 16 GPUs, tp=2, cp=2, pp=2
=> dp = 16 / (2 × 2 × 2) = 2::

    TP     [0,1] [2,3] [4,5] ... [14,15]                              (last axis)
    CP     [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]      (cp axis)
    DP     [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]      (dp axis: the data sampler's)
    DP_CP  [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]              (dp × cp, cp fastest: grads reduce here)
    PP     [0,8] [1,9] ... [7,15]                                     (first axis)
    MP     [0,1,8,9] [2,3,10,11] [4,5,12,13] [6,7,14,15]              (tp × pp, one (dp, cp) index)

Expert layers (mixture of experts) use a second grid over the same ranks, Megatron-core's expert
RankGenerator (order "tp-ep-dp-pp", cp folded into the expert-data-parallel axis): ETP varies fastest, then EP, then expert-data-parallel
(EDP), then PP, with EDP = world / (etp × ep × pp)::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))    i.e. arange(world).view(pp, edp, ep, etp)

Worked example (Megatron ``parallel_state.py`` / MoE README "parallel folding"; checked by
``tests/test_groups.py``): 16 GPUs, tp=2, pp=2 (dense dp=4), expert_model_parallel_size=4,
expert_tensor_parallel_size=1 => EDP = 16 / (1 × 4 × 2) = 2::

    EP     [0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]       (ep axis; folds over the TP pairs of two DP replicas)
    EDP    [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]   (edp axis: expert grads reduce here)
    ETP    [0] [1] ... [15]                                      (etp axis: experts are not tensor-split)
    TP_EP  = EP here (etp × ep: the token dispatcher's group)
    PP     [0,8] [1,9] ... [7,15]                                 (the dense grid's PP groups, by construction)

Sharded data parallelism within groups (HSDP, ``parallel.data_parallel_shard_size`` = S): the dp × cp ranks of
one tp / pp coordinate are cut into R = dp·cp / S groups of S consecutive ones (Megatron-core's
``intra_partial_data_parallel_group``, the ranks of one distributed-optimizer instance: ZeRO-2 / ZeRO-3 shard
there) and the S groups of the ranks at the same place in each (``inter_partial_data_parallel_group``: the R
replicas of one shard, whose grads are all-reduced). Worked example (checked by ``tests/test_groups.py``): 8 GPUs,
tp=2, pp=1 => dp = 4; data_parallel_shard_size=2 => R = 2::

    DP            [0,2,4,6] [1,3,5,7]
    DP_SHARD      [0,2] [4,6] [1,3] [5,7]        (S consecutive DP ranks: FSDP2's "dp_shard" mesh dim)
    DP_REPLICATE  [0,4] [2,6] [1,5] [3,7]        (every S-th DP rank: FSDP2's "dp_replicate" mesh dim)

i.e. ``arange(world).view(pp, dp·cp / S, S, tp)`` (the dp × cp axis, cp fastest, split as (replicate, shard)).
Without the key (or S = dp·cp) DP_SHARD is DP_CP and DP_REPLICATE the single ranks, sharing those handles.

Both grids end in PP, so their PP groups coincide (Megatron asserts it). With ep = 1 and etp = tp
the expert groups are the dense ones (ETP = TP, EDP = DP, TP_EP = TP) and share their handles.

All process-group state lives in one `ParallelGroups` object built by `build_groups` and torn
down by `ParallelGroups.destroy`, so a second layout can be built in the same process (sweeps,
tests). There are no module-level globals.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from mptrain.errors import ConfigError, launch_rank_and_world

DENSE_GROUP_KINDS = ("tp", "pp", "dp", "mp", "embedding", "cp", "dp_cp", "dp_shard", "dp_replicate")
"""... "cp": the context-parallel ranks of one sequence; "dp_cp": dp × cp (dense grads and ZeRO-1 shards);
"dp_shard" / "dp_replicate": HSDP's shard groups and the replicas of one shard (the module docstring)."""
SHARED_DENSE_KINDS = ("cp", "dp_cp", "dp_shard", "dp_replicate")
"""Dense kinds that take the handles of an equal kind built before them (at cp = 1, DP_CP = DP; without HSDP,
DP_SHARD = DP_CP and DP_REPLICATE the single ranks of CP at cp = 1)."""
EXPERT_GROUP_KINDS = ("ep", "etp", "edp", "tp_ep")
"""The expert grid's groups: expert-model-parallel, expert-tensor-parallel, expert-data-parallel, and
etp × ep (the token dispatcher's group; Megatron's ``_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP``)."""
GROUP_KINDS = DENSE_GROUP_KINDS + EXPERT_GROUP_KINDS


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """What the launcher tells a process (read once from the environment by `read_dist_env`).

    `launcher` is "torchrun" (RANK set: torchrun / torch.distributed.run, one or many nodes),
    "slurm" (no RANK, but SLURM_PROCID: one srun task per GPU, e.g. Hydra's submitit launcher)
    or "none" (a single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher: str = "none"
    restart_count: int = 0
    """torchrun's TORCHELASTIC_RESTART_COUNT: 0 on the first attempt, k after k restarts."""
    agent_store: bool = False
    """torchrun's TORCHELASTIC_USE_AGENT_STORE: MASTER_ADDR:MASTER_PORT is the agent's TCPStore,
    which outlives the workers and is shared by every attempt (see `init_distributed`)."""

    @property
    def init_method(self) -> Optional[str]:
        """``tcp://ADDR:PORT`` under SLURM (rank 0 hosts the store); None = ``env://`` (torchrun's agent store)."""
        if self.launcher == "slurm" and self.world_size > 1:
            return f"tcp://{self.master_addr}:{self.master_port}"
        return None


SLURM_DEFAULT_PORT = 29500  # torch's default; only used when SLURM_JOB_ID is missing too


def slurm_first_host(nodelist: str) -> str:
    """The first hostname of a SLURM node list (``gpu[003-004,010]`` -> ``gpu003``).

    Uses submitit's parser when submitit is importable (the `slurm` extra), else
    ``scontrol show hostnames`` (present on every SLURM node).

    Raises:
        ConfigError: neither is available or the list cannot be parsed (set MASTER_ADDR instead).
    """
    try:
        from submitit.slurm.slurm import _parse_node_list  # the `slurm` extra; private but stable since submitit 1.1

        return _parse_node_list(nodelist)[0]
    except ImportError:
        pass
    except Exception as err:  # noqa: BLE001 - a parse error becomes the user-facing one-liner below
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} could not be parsed ({err}); export MASTER_ADDR=<first host>") from None
    import shutil
    import subprocess

    if shutil.which("scontrol") is None:
        raise ConfigError(
            f"SLURM_JOB_NODELIST={nodelist!r}: neither submitit nor scontrol is available to find the first host; "
            "export MASTER_ADDR=<first host> or pip install 'mptrain[slurm]'"
        )
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise ConfigError(f"scontrol show hostnames {nodelist!r} failed ({out.stderr.strip()}); export MASTER_ADDR=<first host>")
    return hosts[0]


def read_dist_env(environ: Optional[dict] = None, *, first_host=slurm_first_host) -> DistEnv:
    """Read the launcher's variables: torchrun's, else SLURM's (defaults: a world of 1).

    torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
    SLURM (when RANK is absent and SLURM_PROCID is set; one task per GPU under srun / submitit):
    rank = SLURM_PROCID, world = SLURM_NTASKS, local rank = SLURM_LOCALID; MASTER_ADDR if set,
    else the first host of SLURM_JOB_NODELIST (`first_host`); MASTER_PORT if set, else
    20000 + SLURM_JOB_ID mod 40000 (every task of a job derives the same port, and two jobs sharing
    a node rarely collide), else 29500. A one-task SLURM job needs no address.

    Args:
        environ: the variables to read (default `os.environ`; tests pass a dict).
        first_host: nodelist -> first hostname (tests inject a fake).
    Raises:
        ConfigError: SLURM without MASTER_ADDR and no way to resolve the node list.
    """
    env = os.environ if environ is None else environ
    port = env.get("MASTER_PORT")
    rank, world_size = launch_rank_and_world(env)
    if "RANK" in env or "SLURM_PROCID" not in env:
        return DistEnv(
            rank=rank,
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
            launcher="torchrun" if "RANK" in env else "none",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0) or 0),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    addr = env.get("MASTER_ADDR")
    if addr is None and world_size > 1:
        addr = first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if port:
        master_port = int(port)
    elif env.get("SLURM_JOB_ID", "").isdigit():
        master_port = 20000 + int(env["SLURM_JOB_ID"]) % 40000
    else:
        master_port = SLURM_DEFAULT_PORT
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        master_addr=addr,
        master_port=master_port,
        launcher="slurm",
    )


def init_distributed(env: DistEnv, *, timeout_s: float = 600.0, device_type: Optional[str] = None) -> torch.device:
    """Initialise the default process group and pick this process's device.

    NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), gloo otherwise (``cpu``). A world
    of one needs no torchrun: it uses an in-memory store. When a default group already exists
    (the persistent test pool, a Hydra sweep's second job) it is reused.

    Args:
        env: the launcher's environment (`read_dist_env`: torchrun's, or SLURM's).
        timeout_s: collective timeout in seconds; a stalled rank fails the job after this long.
        device_type: "cuda" or "cpu"; None picks cuda when available.
    Returns:
        the torch.device this rank computes on.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.world_size == 1 and env.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        if env.init_method is not None:  # SLURM: no torchrun agent store, rank 0 hosts a TCP store
            kwargs["init_method"] = env.init_method
        elif env.agent_store and env.master_addr is not None and env.master_port is not None:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
            kwargs["store"] = dist.PrefixStore(f"mptrain/attempt_{env.restart_count}", store)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    return device


TORCHRUN_WORLD_SIZE_FLAG = "--nproc_per_node"
"""What sets the world size in the fix of a layout it does not divide (`validate_layout`): the trainer's
launch; `mptrain.plan` / `mptrain.check` pass ``world_size``."""


def validate_layout(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    world_size_flag: str = TORCHRUN_WORLD_SIZE_FLAG,
) -> int:
    """Check a layout and return the data-parallel size world / (tp × cp × pp) (``world_size_flag``:
    `TORCHRUN_WORLD_SIZE_FLAG`).

    The expert grid (`expert_layout`) must tile the same world: etp × ep × pp divides it
    (Megatron ``initialize_model_parallel``); ``expert_tensor_parallel_size=None`` means tp.

    Raises:
        ConfigError: sizes below 1, world size not divisible by tp x pp, by tp x cp x pp or by etp x ep x pp,
            or a virtual pipeline without pp > 1 (one line with the numbers and the fix).
    """
    tp, pp, vpp = tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    cp = context_parallel_size
    if tp < 1 or pp < 1 or world_size < 1:
        raise ConfigError(
            f"parallel: tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp} and world size "
            f"{world_size} must all be >= 1"
        )
    if world_size % (tp * pp) != 0:
        multiples = [tp * pp * k for k in (1, 2)]
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size × "
            f"pipeline_model_parallel_size = {tp * pp}; run with {world_size_flag}={multiples[0]} or "
            f"{multiples[1]}, or pick another parallel="
        )
    if vpp is not None:
        if vpp < 1:
            raise ConfigError(f"parallel: virtual_pipeline_model_parallel_size={vpp} must be >= 1 or null")
        if vpp > 1 and pp == 1:
            raise ConfigError(
                f"parallel: virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                "(got 1); set virtual_pipeline_model_parallel_size=null or pick parallel=tp1pp2vpp2"
            )
    if cp < 1:
        raise ConfigError(f"parallel.context_parallel_size={cp} must be >= 1 (1 = no context parallelism)")
    if world_size % (tp * cp * pp) != 0:
        multiples = [tp * cp * pp * k for k in (1, 2)]
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size × "
            f"context_parallel_size × pipeline_model_parallel_size = {tp} × {cp} × {pp} = {tp * cp * pp}; run with "
            f"{world_size_flag}={multiples[0]} or {multiples[1]}, or set parallel.context_parallel_size to a divisor "
            f"of {world_size // (tp * pp)}"
        )
    expert_layout(world_size, tp, pp, expert_model_parallel_size, expert_tensor_parallel_size,
                  world_size_flag=world_size_flag)
    return world_size // (tp * cp * pp)


def expert_layout(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    *,
    world_size_flag: str = TORCHRUN_WORLD_SIZE_FLAG,
) -> tuple[int, int, int]:
    """(etp, ep, edp) of the expert grid: etp = ``expert_tensor_parallel_size`` or tp when null (Megatron's
    default), edp = world / (etp × ep × pp) (Megatron ``parallel_state.initialize_model_parallel``).

    The model's expert count vs ep is `check_num_experts` (it needs the model's keys).

    Raises:
        ConfigError: ep or etp below 1, or etp × ep × pp not dividing the world size (one line naming
            the key and the fix).
    """
    ep, pp = expert_model_parallel_size, pipeline_model_parallel_size
    etp = tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if ep < 1:
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} must be >= 1 (1 = no expert parallelism)")
    if etp < 1:
        raise ConfigError(f"parallel.expert_tensor_parallel_size={etp} must be >= 1, or null "
                          "(= tensor_model_parallel_size)")
    if world_size % (etp * ep * pp) != 0:
        # the fix: an ep the world takes at this etp × pp, else a world both grids tile
        eps = [k for k in range(1, world_size // (etp * pp) + 1) if world_size % (etp * pp * k) == 0]
        tile = math.lcm(tensor_model_parallel_size * pp, etp * ep * pp)
        fix = (f"set parallel.expert_model_parallel_size to one of {eps}" if eps else
               f"set parallel.expert_tensor_parallel_size to a divisor of {world_size // pp}")
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by expert_tensor_parallel_size × "
            f"expert_model_parallel_size × pipeline_model_parallel_size = {etp} × {ep} × {pp} = {etp * ep * pp}; "
            f"{fix}, or run with {world_size_flag}={tile}"
        )
    return etp, ep, world_size // (etp * ep * pp)


def check_num_experts(num_moe_experts: Optional[int], expert_model_parallel_size: int) -> None:
    """Each EP rank holds E / ep whole experts of an MoE layer (Megatron ``arguments.py``: num_experts % ep == 0);
    `mptrain.training.validate` calls it with ``model.num_moe_experts``, the token dispatchers with their E.

    Raises:
        ConfigError: ep > 1 for a dense model (``num_moe_experts`` null), or E not divisible by ep.
    """
    ep = expert_model_parallel_size
    if num_moe_experts is None:
        if ep > 1:
            raise ConfigError(
                f"parallel.expert_model_parallel_size={ep} splits the experts of MoE layers, and model.num_moe_experts "
                "is null (a dense model); set model.num_moe_experts or parallel.expert_model_parallel_size=1"
            )
        return
    if num_moe_experts % ep != 0:
        divisors = [d for d in range(1, num_moe_experts + 1) if num_moe_experts % d == 0]
        raise ConfigError(
            f"model.num_moe_experts={num_moe_experts} is not divisible by parallel.expert_model_parallel_size={ep}; "
            f"set parallel.expert_model_parallel_size to one of {divisors} or model.num_moe_experts to a multiple of {ep}"
        )


def check_shard_size(data_parallel_shard_size: Optional[int], dp_cp: int) -> int:
    """HSDP's shard group size S: ``parallel.data_parallel_shard_size``, null = the whole dp × cp group.

    Raises:
        ConfigError: S below 1 or not dividing dp × cp (one line with the divisors).
    """
    shard = dp_cp if data_parallel_shard_size is None else data_parallel_shard_size
    if shard < 1 or dp_cp % shard != 0:
        divisors = [d for d in range(1, dp_cp + 1) if dp_cp % d == 0]
        raise ConfigError(f"parallel.data_parallel_shard_size={data_parallel_shard_size} must divide the data-parallel "
                          f"size {dp_cp} (shard within groups of that many DP ranks, replicate across them); set it to "
                          f"one of {divisors} or null (shard over the whole DP group)")
    return shard


def rank_groups(world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int, *,
                expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                context_parallel_size: int = 1, data_parallel_shard_size: Optional[int] = None) -> dict:
    """The rank lists of every group kind, as Megatron builds them (pure; no torch.distributed).

    Dense ranks are laid out as ``arange(world).view(pp, dp, cp, tp)``, expert ranks as
    ``arange(world).view(pp, edp, ep, etp)`` (see the module docstring). Groups of one kind are listed
    with the remaining axes in Megatron's order, the fastest one (tp, then cp, dp, pp) varying fastest.

    Returns:
        {"tp", "pp", "dp", "mp", "embedding", "cp", "dp_cp", "dp_shard", "dp_replicate", "ep", "etp", "edp",
        "tp_ep": [...]}, each a list of rank lists, groups in Megatron's order. "mp" is tp x pp for one (dp, cp)
        index; "embedding" is [first, last] of each PP group ([first] when pp == 1); "dp_cp" is dp x cp (cp
        fastest); "dp_shard" / "dp_replicate" cut each dp_cp group into ``data_parallel_shard_size`` consecutive
        ranks / every S-th rank (Megatron's intra / inter partial data-parallel groups: for each dp_cp group in
        order, its slices in order); "tp_ep" is etp x ep (etp fastest).
    Raises:
        ConfigError: see `validate_layout`, `check_shard_size`.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = validate_layout(world_size, tp, pp, context_parallel_size=cp)
    etp, ep, edp = expert_layout(world_size, tp, pp, expert_model_parallel_size, expert_tensor_parallel_size)
    grid = torch.arange(world_size).view(pp, dp, cp, tp)
    shard = check_shard_size(data_parallel_shard_size, dp * cp)
    hybrid = grid.reshape(pp, dp * cp // shard, shard, tp)  # the dp × cp axis (cp fastest) as (replicate, shard)
    tp_groups = grid.reshape(-1, tp).tolist()
    cp_groups = grid.permute(0, 1, 3, 2).reshape(-1, cp).tolist()  # groups ordered (pp, dp, tp)
    dp_groups = grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist()  # groups ordered (pp, cp, tp)
    dp_cp_groups = grid.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()  # groups ordered (pp, tp); cp fastest inside
    pp_groups = grid.permute(1, 2, 3, 0).reshape(-1, pp).tolist()
    mp_groups = grid.permute(1, 2, 0, 3).reshape(dp * cp, pp * tp).tolist()
    embedding_groups = [[g[0], g[-1]] if pp > 1 else [g[0]] for g in pp_groups]
    expert = torch.arange(world_size).view(pp, edp, ep, etp)
    return {
        "tp": tp_groups, "pp": pp_groups, "dp": dp_groups, "mp": mp_groups, "embedding": embedding_groups,
        "cp": cp_groups, "dp_cp": dp_cp_groups,
        "dp_shard": hybrid.permute(0, 3, 1, 2).reshape(-1, shard).tolist(),  # groups ordered (pp, tp, replicate)
        "dp_replicate": hybrid.permute(0, 3, 2, 1).reshape(-1, dp * cp // shard).tolist(),  # (pp, tp, shard)
        "etp": expert.reshape(-1, etp).tolist(),
        "ep": expert.permute(0, 1, 3, 2).reshape(-1, ep).tolist(),  # groups ordered (pp, edp, etp)
        "edp": expert.permute(0, 2, 3, 1).reshape(-1, edp).tolist(),  # groups ordered (pp, ep, etp)
        "tp_ep": expert.reshape(-1, ep * etp).tolist(),
    }


def rank_coordinates(rank: int, world_size: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank in the ``view(pp, dp, cp, tp)`` grid (`cp_rank` gives cp's)."""
    dp = world_size // (tp * cp * pp)
    return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


def cp_rank_of(rank: int, tp: int, cp: int) -> int:
    """The cp coordinate of a global rank in the ``view(pp, dp, cp, tp)`` grid."""
    return (rank // tp) % cp


def expert_rank_coordinates(rank: int, world_size: int, etp: int, ep: int, pp: int) -> tuple[int, int, int, int]:
    """(etp_rank, ep_rank, edp_rank, pp_rank) of a global rank in the ``view(pp, edp, ep, etp)`` grid."""
    edp = world_size // (etp * ep * pp)
    return rank % etp, (rank // etp) % ep, (rank // (etp * ep)) % edp, rank // (etp * ep * edp)


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """Every process group of one layout and the facts derived from it (Megatron's parallel_state, as an object).

    Build with `build_groups`; call `destroy` before building another layout in the same process.
    Group handles are None only for kinds this rank is not part of (the embedding group of a
    middle pipeline stage). The expert grid's groups (`EXPERT_GROUP_KINDS`) and their ranks and
    sizes derive from ``ranks`` (``ep_rank`` = this rank's index in its EP group, ...).
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    vpp_size: Optional[int]
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ranks: dict  # kind -> this rank's group as a list of global ranks (None if not a member)
    handles: dict  # kind -> ProcessGroup (None if not a member)
    all_groups: tuple = ()  # every ProcessGroup created, for teardown
    device: torch.device = torch.device("cpu")
    host_group: Any = None  # a gloo group over all ranks when the default one is not gloo (NCCL); None: the default
    cp_size: int = 1
    """Context-parallel size: the ranks that hold slices of one sequence (``parallel.context_parallel_size``)."""
    cp_rank: int = 0
    """This rank's index in its CP group: it holds chunks cp_rank and 2·cp − 1 − cp_rank of each sequence."""

    # --- host flags -----------------------------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank: one tiny all-reduce of host memory (gloo), so that the
        accelerator's queue of enqueued work is neither waited for nor drained (the stop signal's
        per-iteration check; an NCCL all-reduce read back with ``.item()`` would wait for the step)."""
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t.item())

    # --- group handles -----------------------------------------------------------------
    @property
    def tp_group(self):
        return self.handles["tp"]

    @property
    def pp_group(self):
        return self.handles["pp"]

    @property
    def dp_group(self):
        return self.handles["dp"]

    @property
    def mp_group(self):
        return self.handles["mp"]

    @property
    def embedding_group(self):
        return self.handles["embedding"]

    # --- context parallelism ------------------------------------------------------------------
    @property
    def cp_group(self):
        """The ranks that hold slices of the same sequences (attention exchanges K/V here)."""
        return self.handles.get("cp")

    @property
    def dp_cp_group(self):
        """Data-parallel with context: dp × cp, the replicas of every dense weight (grads and ZeRO-1 shards)."""
        return self.handles.get("dp_cp", self.handles["dp"]) if self.cp_size > 1 else self.handles["dp"]

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """Index in `dp_cp_group`: dp_rank · cp + cp_rank (cp fastest, Megatron's order)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    # --- sharded data parallelism within groups (HSDP) ----------------------------------------
    @property
    def dp_shard_group(self):
        """The ranks ZeRO-2 / ZeRO-3 shard over: ``data_parallel_shard_size`` consecutive dp × cp ranks (all of them
        without HSDP: the `dp_cp_group`'s ranks)."""
        return self.handles["dp_shard"]

    @property
    def dp_replicate_group(self):
        """The replicas of one shard (one rank in each shard group); a single rank without HSDP."""
        return self.handles["dp_replicate"]

    @property
    def dp_shard_size(self) -> int:
        return len(self.ranks["dp_shard"])

    @property
    def dp_replicate_size(self) -> int:
        return len(self.ranks["dp_replicate"])

    # --- expert grid (MoE layers) ----------------------------------------------------------
    @property
    def ep_group(self):
        """Expert-model-parallel: the ranks that split the experts of one layer (E / ep each)."""
        return self.handles["ep"]

    @property
    def etp_group(self):
        """Expert-tensor-parallel: the ranks that split each expert's FFN (the experts' TP)."""
        return self.handles["etp"]

    @property
    def edp_group(self):
        """Expert-data-parallel: the replicas of one expert shard (expert grads reduce here)."""
        return self.handles["edp"]

    @property
    def tp_ep_group(self):
        """etp x ep: the token dispatcher's group (every rank whose tokens may reach this rank's experts)."""
        return self.handles["tp_ep"]

    def _index_in(self, kind: str) -> int:
        return self.ranks[kind].index(self.rank)

    @property
    def ep_size(self) -> int:
        return len(self.ranks["ep"])

    @property
    def ep_rank(self) -> int:
        """This rank's index in its EP group: it holds global experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
        return self._index_in("ep")

    @property
    def etp_size(self) -> int:
        return len(self.ranks["etp"])

    @property
    def etp_rank(self) -> int:
        return self._index_in("etp")

    @property
    def edp_size(self) -> int:
        return len(self.ranks["edp"])

    @property
    def edp_rank(self) -> int:
        return self._index_in("edp")

    # --- pipeline facts -----------------------------------------------------------------
    def is_pipeline_first_stage(self, vp_stage: Optional[int] = None) -> bool:
        """True on pp rank 0 (and, for a virtual chunk index, only for chunk 0)."""
        return self.pp_rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_pipeline_last_stage(self, vp_stage: Optional[int] = None) -> bool:
        """True on the last pp rank (and, for a virtual chunk index, only for the last chunk)."""
        last_chunk = (self.vpp_size or 1) - 1
        return self.pp_rank == self.pp_size - 1 and (vp_stage is None or vp_stage == last_chunk)

    @property
    def is_first_stage(self) -> bool:
        return self.is_pipeline_first_stage()

    @property
    def is_last_stage(self) -> bool:
        return self.is_pipeline_last_stage()

    @property
    def next_pp_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as Megatron's p2p does)."""
        return self.ranks["pp"][(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.ranks["pp"][(self.pp_rank - 1) % self.pp_size]

    @property
    def first_pp_rank(self) -> int:
        return self.ranks["pp"][0]

    @property
    def last_pp_rank(self) -> int:
        return self.ranks["pp"][-1]

    @property
    def tp_src_rank(self) -> int:
        """Global rank of tp rank 0 in this rank's TP group (the one that reads data)."""
        return self.ranks["tp"][0]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.ranks["embedding"] is not None

    def coordinates(self) -> dict:
        """{"rank", "tp", "dp", "pp", "vpp"} for logs and layout.json."""
        return {"rank": self.rank, "tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank, "vpp": self.vpp_size}

    def destroy(self) -> None:
        """Destroy the sub-groups of this layout (the default group stays).

        Only on a clean end (or an error every rank raised alike): destroying an NCCL communicator
        while a peer still waits in a collective hangs, so a failing rank exits without it.
        """
        for group in self.all_groups:
            dist.destroy_process_group(group)

    def set_timeout(self, timeout_s: float) -> None:
        """Change the collective timeout of the default group and of every sub-group of this layout.

        Used after the first step (`train.step_timeout_s`): start-up may legitimately wait long
        (compilation, data preprocessing on rank 0), a step should not. torch's
        ``_set_pg_timeout`` (NCCL's watchdog aborts a collective past it; gloo raises).
        """
        timeout = datetime.timedelta(seconds=timeout_s)
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, None)
        for group in self.all_groups:
            if self.rank in dist.get_process_group_ranks(group):
                _set_pg_timeout(timeout, group)


def build_groups(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    data_parallel_shard_size: Optional[int] = None,
    device: torch.device = torch.device("cpu"),
) -> ParallelGroups:
    """Create the process groups of a layout on the initialised default group (collective on all ranks).

    Every rank calls `torch.distributed.new_group` for every group in the same order (required
    by torch), and keeps the handles of the groups it belongs to. An expert kind or a kind of
    `SHARED_DENSE_KINDS` whose rank lists equal those of a kind already built (ETP = TP, EDP = DP when
    ep = 1, etp = tp and cp = 1; DP_CP = DP when cp = 1; without HSDP DP_SHARD = DP_CP, DP_REPLICATE = the
    single ranks) takes that kind's handles instead of new groups.

    Raises:
        ConfigError: invalid layout (before any collective; every rank raises the same error).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    vpp = virtual_pipeline_model_parallel_size
    expert = {"expert_model_parallel_size": expert_model_parallel_size,
              "expert_tensor_parallel_size": expert_tensor_parallel_size}
    cp = context_parallel_size
    dp = validate_layout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size, vpp,
                         context_parallel_size=cp, **expert)
    lists = rank_groups(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                        context_parallel_size=cp, data_parallel_shard_size=data_parallel_shard_size, **expert)
    ranks: dict = {kind: None for kind in GROUP_KINDS}
    handles: dict = {kind: None for kind in GROUP_KINDS}
    created = []
    built: dict = {}  # kind -> {tuple(group ranks): handle}, for the kinds built so far
    for kind in GROUP_KINDS:
        # only an expert kind shares an equal kind's handles: each dense kind keeps its own communicators
        shared = kind in EXPERT_GROUP_KINDS or kind in SHARED_DENSE_KINDS
        # equal as sets of groups: the single ranks of DP_REPLICATE come in another order than CP's
        same = next((k for k in built if sorted(lists[k]) == sorted(lists[kind])), None) if shared else None
        built[kind] = {}
        for group_ranks in lists[kind]:
            if same is not None:
                group = built[same][tuple(group_ranks)]
            else:
                group = dist.new_group(group_ranks)
                created.append(group)
            built[kind][tuple(group_ranks)] = group
            if rank in group_ranks:
                ranks[kind], handles[kind] = group_ranks, group
    host_group = None
    if dist.get_backend() != "gloo":  # host-memory flags travel over gloo (`ParallelGroups.any_rank`)
        host_group = dist.new_group(list(range(world_size)), backend="gloo")
        created.append(host_group)
    tp_rank, dp_rank, pp_rank = rank_coordinates(rank, world_size, tensor_model_parallel_size,
                                                 pipeline_model_parallel_size, cp)
    return ParallelGroups(
        world_size=world_size,
        rank=rank,
        tp_size=tensor_model_parallel_size,
        pp_size=pipeline_model_parallel_size,
        dp_size=dp,
        vpp_size=vpp if (vpp or 1) > 1 else None,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        ranks=ranks,
        handles=handles,
        all_groups=tuple(created),
        device=device,
        host_group=host_group,
        cp_size=cp,
        cp_rank=cp_rank_of(rank, tensor_model_parallel_size, cp),
    )
