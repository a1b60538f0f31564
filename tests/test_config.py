"""Config tree: every option of every group composes and validates; each DESIGN.md §5 error names its key."""

import re
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mptrain.config.schema import register
from mptrain.config.schema import as_config
from mptrain.data.tokenizers import check_vocab_size
from mptrain.training.validate import DerivedLayout, validate_config
from mptrain.errors import ConfigError
from procs import run_python

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")  # every shipped group

register()


@pytest.fixture(autouse=True, scope="module")
def _hydra():
    # One Hydra initialisation for the module (composition itself is what the tests exercise).
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _compose(overrides=()):
    return compose(config_name="config", overrides=list(overrides))


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _tp_pp(option):
    """tp, pp of a parallel option name like tp2pp4 / tp1pp2vpp2."""
    tp, pp = re.match(r"tp(\d+)pp(\d+)", option).groups()
    return int(tp), int(pp)


# A compatible context for validating each option (the option alone may be invalid with the defaults,
# e.g. parallel=tp8pp1 with model=tiny's 4 heads; those combinations are tested as errors below).
def _context(group, option):
    if group == "parallel":
        tp, pp = _tp_pp(option)
        return ["model=gpt_1.3b"], tp * pp  # 24 layers, 16 heads: fits every shipped layout
    if group == "schedule":
        layout = {"gpipe": "tp1pp2", "1f1b": "tp1pp2", "interleaved_1f1b": "tp1pp2vpp2"}.get(option, "tp1pp1")
        return [f"parallel={layout}"], _tp_pp(layout)[0] * _tp_pp(layout)[1]
    if group == "loss_scaler":
        return (["precision=fp32"] if option == "none" else ["precision=fp16"]), 1
    if (group, option) == ("data", "indexed"):
        return ["data.prefixes=[/data/corpus_text_document]"], None  # its corpus is the one key it needs
    return [], None  # the world its own layout needs (experiment files pick a parallel=)


def test_cfg_job_prints_the_resolved_config(tmp_path):
    proc = run_python([str(CONF.parent / "train.py"), "--cfg", "job", "parallel=tp2pp4", "precision=bf16"], cwd=tmp_path,
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["parallel"]["tensor_model_parallel_size"] == 2 and printed["parallel"]["pipeline_model_parallel_size"] == 4
    assert printed["precision"]["name"] == "bf16"
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_every_group_has_its_design_options():
    expected = {
        "model": {"tiny", "gpt_125m", "gpt_350m", "gpt_1.3b", "gpt_2.7b", "gpt_6.7b", "gpt_13b", "seed_2.8b"},
        "parallel": {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp4pp1", "tp1pp4", "tp2pp4", "tp4pp2", "tp8pp1", "tp1pp8",
                     "tp1pp2vpp2", "tp1pp4vpp2", "tp2pp2vpp2"},
        "schedule": {"auto", "no_pipelining", "gpipe", "1f1b", "interleaved_1f1b"},
        "precision": {"fp32", "bf16", "fp16"},
        "loss_scaler": {"auto", "dynamic", "constant", "none"},
        "optim": {"adam", "adamw", "sgd"},
        "data": {"mock", "indexed", "shakespeare"},
        "logger": {"none", "wandb", "tensorboard"},
    }
    for group, options in expected.items():
        assert options <= set(_options(group)), group


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_dry_run_every_option_composes_and_validates(group, option):
    extra, world = _context(group, option)
    cfg = _compose([f"{group}={option}", *extra])
    if group != "experiment":  # experiment files are global overlays, not a node
        assert cfg[group].name == option  # each option file names itself (used in run.dir and summaries)
    if world is None:
        world = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    c = as_config(cfg)  # what validate_config does first (suite time: one conversion, not two)
    derived = validate_config(c, world)
    assert isinstance(derived, DerivedLayout)
    assert derived.world_size == world
    assert c.train.global_batch_size == derived.num_microbatches * c.train.micro_batch_size * derived.data_parallel_size


@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        (["parallel=tp1pp1"], 1, ("no_pipelining", 1, None, 4)),
        (["parallel=tp1pp1"], 4, ("no_pipelining", 4, None, 1)),
        (["parallel=tp2pp2"], 4, ("1f1b", 1, None, 4)),
        (["parallel=tp1pp2vpp2"], 2, ("interleaved_1f1b", 1, 2, 4)),
        (["parallel=tp1pp2", "schedule=gpipe"], 2, ("gpipe", 1, None, 4)),
        (["parallel=tp1pp1", "schedule=gpipe"], 1, ("no_pipelining", 1, None, 4)),  # pp = 1 degenerates
        (["parallel=tp1pp1", "schedule=1f1b"], 2, ("no_pipelining", 2, None, 2)),
        (["parallel=tp2pp1", "train.global_batch_size=16", "train.micro_batch_size=1"], 4, ("no_pipelining", 2, None, 8)),
    ],
)
def test_derived_layout_tiny(overrides, world, expected):
    d = validate_config(_compose(["model=tiny", *overrides]), world)
    assert (d.schedule, d.data_parallel_size, d.virtual_pipeline_model_parallel_size, d.num_microbatches) == expected


def test_derived_expert_grid():
    d = validate_config(_compose(["model=tiny", "parallel=tp2pp1"]), 4)  # etp null = tp; ep 1
    assert (d.expert_model_parallel_size, d.expert_tensor_parallel_size, d.expert_data_parallel_size) == (1, 2, 2)
    d = validate_config(_compose(["model=tiny", "parallel=tp2pp2", "parallel.expert_tensor_parallel_size=1"]), 8)
    assert (d.expert_model_parallel_size, d.expert_tensor_parallel_size, d.expert_data_parallel_size) == (1, 1, 4)


def test_resolved_loss_scaler_and_sequence_parallel():
    assert validate_config(_compose(["precision=fp16"]), 1).loss_scaler == "dynamic"
    assert validate_config(_compose(["precision=bf16"]), 1).loss_scaler == "none"
    assert validate_config(_compose(["precision=fp16", "loss_scaler=constant"]), 1).loss_scaler == "constant"
    # sequence_parallel with tp = 1: allowed, and a no-op
    assert validate_config(_compose(["parallel.sequence_parallel=true"]), 1).sequence_parallel is False
    assert validate_config(_compose(["parallel=tp2pp1", "parallel.sequence_parallel=true"]), 2).sequence_parallel is True


# Each DESIGN.md §5 combination: (overrides, world size, text the one-line message must contain).
INVALID = [
    (["parallel=tp2pp2"], 6, "world size 6 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size"),
    (["parallel=tp8pp1"], 8, "model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=8"),
    (["model.hidden_size=66"], 1, "model.hidden_size=66 is not divisible by model.num_attention_heads=4"),
    (["parallel=tp1pp8"], 8, "model.num_layers=4 is not divisible by pipeline_model_parallel_size = 8"),
    (["parallel=tp1pp4vpp2"], 4, "model.num_layers=4 is not divisible by pipeline_model_parallel_size × virtual_pipeline_model_parallel_size"),
    (["parallel=tp1pp4", "model.num_layers=5", "parallel.decoder_first_pipeline_num_layers=1"], 4,
     "the other 3 pipeline stage(s) get 4 of model.num_layers=5"),
    (["parallel=tp1pp1", "parallel.decoder_last_pipeline_num_layers=2"], 1, "decoder_last_pipeline_num_layers need pipeline_model_parallel_size > 1"),
    (["train.step_timeout_s=0"], 1, "train.step_timeout_s=0.0 must be a number of seconds > 0 and <= 1e+09 or null"),
    (["train.timeout_s=-1"], 1, "train.timeout_s=-1.0 must be a number of seconds > 0 and <= 1e+09"),
    (["train.step_timeout_s=inf"], 1, "train.step_timeout_s=inf must be a number of seconds > 0 and <= 1e+09 or null"),
    (["train.step_timeout_s=1e13"], 1, "train.step_timeout_s=10000000000000.0 must be a number of seconds > 0"),
    (["train.timeout_s=inf"], 1, "train.timeout_s=inf must be a number of seconds > 0 and <= 1e+09"),
    (["train.global_batch_size=10"], 4, "train.global_batch_size=10 is not divisible by train.micro_batch_size × data-parallel size = 2 × 4 = 8"),
    (["precision=fp16", "loss_scaler=none"], 1, "precision=fp16 with loss_scaler=none"),
    (["parallel=tp1pp2", "schedule=interleaved_1f1b"], 2, "virtual_pipeline_model_parallel_size is null but schedule=interleaved_1f1b"),
    (["parallel.virtual_pipeline_model_parallel_size=2"], 1, "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
    (["parallel=tp1pp2vpp2", "schedule=1f1b"], 2, "virtual_pipeline_model_parallel_size=2 needs schedule=interleaved_1f1b"),
    (["parallel=tp1pp2vpp2", "train.global_batch_size=6"], 2, "needs num_microbatches % pipeline_model_parallel_size == 0, got 3"),
    (["parallel=tp1pp2", "schedule=no_pipelining"], 2, "schedule=no_pipelining cannot run pipeline_model_parallel_size=2"),
    (["parallel=tp2pp1", "parallel.sequence_parallel=true", "model.seq_length=63"], 2, "model.seq_length=63 is not divisible by tensor_model_parallel_size=2"),
    (["parallel=tp2pp1", "parallel.tp_comm_overlap=true", "model.compile_layers=true"], 2,
     "on CUDA GPUs with NCCL; it also needs parallel.sequence_parallel=true (got tp=2)"),
    (["parallel=tp2pp1", "parallel.tp_comm_overlap=true", "parallel.sequence_parallel=true"], 2,
     "it also needs model.compile_layers=true (got tp=2)"),
    (["parallel.tp_comm_overlap=true", "parallel.sequence_parallel=true", "model.compile_layers=true"], 1,
     "it also needs tensor_model_parallel_size > 1 (got tp=1)"),
    (["parallel.tp_comm_overlap=true"], 1, "it also needs tensor_model_parallel_size > 1 and "
     "parallel.sequence_parallel=true and model.compile_layers=true (got tp=1)"),
    (["schedule.name=zigzag"], 1, "schedule.name: unknown option 'zigzag'"),
    (["model.activation=relu"], 1, "model.activation: unknown option 'relu'"),
    (["logger.mode=loud"], 1, "logger.mode: unknown option 'loud'"),
    (["debug.fail_where=backward"], 1, "debug.fail_where: unknown option 'backward'; valid: forward, data, save"),
    (["model.num_query_groups=3"], 1, "model.num_attention_heads=4 is not divisible by model.num_query_groups=3"),
    (["parallel=tp4pp1", "model.num_query_groups=2"], 4, "model.num_query_groups=2 is not divisible by parallel.tensor_model_parallel_size=4"),
    (["model.recompute_granularity=full"], 1, "model.recompute_granularity=full needs model.recompute_method"),
    (["train.exit_interval=4"], 1, "train.exit_interval=4 needs checkpoint.save"),
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size=0 must be an integer >= 1"),
    (["parallel.expert_model_parallel_size=3"], 4, "world size 4 is not divisible by expert_tensor_parallel_size × "
     "expert_model_parallel_size × pipeline_model_parallel_size = 1 × 3 × 1 = 3; set parallel.expert_model_parallel_size "
     "to one of [1, 2, 4]"),
    (["parallel=tp2pp1", "parallel.expert_tensor_parallel_size=4"], 2, "= 4 × 1 × 1 = 4; set "
     "parallel.expert_tensor_parallel_size to a divisor of 2, or run with --nproc_per_node=4"),
    (["parallel.expert_model_parallel_size=0"], 1, "parallel.expert_model_parallel_size=0 must be an integer >= 1"),
    (["parallel.expert_model_parallel_size=2"], 2, "parallel.expert_model_parallel_size=2 splits the experts of MoE "
     "layers, and model.num_moe_experts is null (a dense model)"),
]


@pytest.mark.parametrize("overrides,world,message", INVALID)
def test_invalid_combination_one_line_naming_the_key(overrides, world, message):
    cfg = _compose(["model=tiny", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world)
    text = str(err.value)
    assert message in text
    assert "\n" not in text  # one line


def test_tp_comm_overlap_needs_nccl():
    from mptrain.layers.mappings import enable_tp_comm_overlap

    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap=true needs CUDA GPUs and NCCL"):
        enable_tp_comm_overlap(None)
    cfg = _compose(["model=tiny", "parallel=tp2pp1", "parallel.tp_comm_overlap=true", "parallel.sequence_parallel=true",
                    "model.compile_layers=true"])
    assert validate_config(cfg, 2).sequence_parallel is True


def test_uneven_split_accepted_when_it_adds_up():
    cfg = _compose(["parallel=tp1pp4", "model.num_layers=6", "parallel.decoder_first_pipeline_num_layers=3",
                    "parallel.decoder_last_pipeline_num_layers=1"])
    assert validate_config(cfg, 4).pipeline_model_parallel_size == 4  # middle stages: (6-3-1)/2 = 1 layer each
    cfg = _compose(["parallel=tp1pp2", "model.num_layers=5", "parallel.decoder_first_pipeline_num_layers=2"])
    assert validate_config(cfg, 2).num_microbatches == 4


def test_vocab_size_vs_tokenizer():
    assert check_vocab_size(None, 256) == 256
    assert check_vocab_size(300, 256) == 300
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 is smaller than the tokenizer's 256 ids"):
        check_vocab_size(100, 256)


@pytest.mark.parametrize(
    "overrides",
    [["train.micro_batchsize=2"], ["train.micro_batch_size=abc"], ["parallel=tp3pp1"], ["model.num_layers=1.5"],
     ["parallel.tf32_wgrad_transpose=false"]],  # a removed key: the runtime decides the TF32 K-major operand
)
def test_typos_and_wrong_types_fail_at_compose_time(overrides):
    with pytest.raises((HydraException, OmegaConfBaseException)):
        _compose(overrides)


@pytest.mark.parametrize("override, key", [("+parallel.tf32_wgrad_transposee=false", "parallel.tf32_wgrad_transposee"),
                                           ("+train.trian_iters=1", "train.trian_iters"), ("+seed=3", "seed")])
def test_key_added_with_plus_that_the_schema_lacks_fails(override, key):
    """Hydra's ``+`` forces a new key into a typed group, and the schema merge keeps it: as_config rejects it."""
    cfg = _compose([override])  # composes: the key is in the DictConfig
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: unknown config key .*valid keys of "):
        as_config(cfg)


@pytest.mark.parametrize("override, pointer", [
    ("+train.trian_iters=1", "train.trian_iters: unknown config key (misspelt? `+` adds keys the schema does not have); "
                             "did you mean train.train_iters? valid keys of train: "),
    ("+num_layers=4", "num_layers: unknown config key (misspelt? `+` adds keys the schema does not have); "
                      "did you mean model.num_layers? valid keys of the top level: "),  # Megatron's flat name
    ("+parallel.xyzzy=1", "parallel.xyzzy: unknown config key (misspelt? `+` adds keys the schema does not have); "
                          "valid keys of parallel: "),  # nothing close: no guess
])
def test_a_key_added_with_plus_names_the_closest_key(override, pointer):
    with pytest.raises(ConfigError) as info:
        as_config(_compose([override]))
    assert str(info.value).startswith(pointer), str(info.value)


def test_typo_in_an_option_file_fails_at_compose_time(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "parallel" / "bad.yaml").write_text(
        "defaults:\n  - base_parallel\n  - _self_\n\nname: bad\ntensor_model_paralel_size: 2\n"
    )
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    outer = gh.hydra  # the module fixture's Hydra, put back below
    gh.clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            with pytest.raises((HydraException, OmegaConfBaseException), match="tensor_model_paralel_size"):
                compose(config_name="config", overrides=["parallel=bad"])
    finally:
        gh = GlobalHydra.instance()  # the inner context's exit may have swapped the singleton
        gh.clear()
        gh.initialize(outer)
    assert _compose(["parallel=tp2pp1"]).parallel.tensor_model_parallel_size == 2


def test_as_config_rejects_unknown_keys_of_a_saved_plain_config():
    from omegaconf import OmegaConf

    plain = OmegaConf.create({"train": {"train_iters": 3, "nope": 1}})
    with pytest.raises(OmegaConfBaseException, match="nope"):
        as_config(plain)
    assert as_config(OmegaConf.create({"train": {"train_iters": 3}})).train.train_iters == 3


def test_no_per_process_resolvers_in_conf():
    # ${now:...}, ${oc.env:...} and random values resolve differently per rank (hydra#2070).
    for path in CONF.rglob("*.yaml"):
        text = path.read_text()
        assert "${now:" not in text and "oc.env" not in text, path


def test_hydra_inert_settings():
    cfg = compose(config_name="config", overrides=["run.dir=/tmp/x"], return_hydra_config=True)
    h = cfg.hydra
    assert h.output_subdir is None and h.job.chdir is False and h.run.dir == "."
    assert h.sweep.dir == "/tmp/x" and h.sweep.subdir == "."
    assert h.job_logging == {} or "handlers" not in h.job_logging  # job_logging: none
