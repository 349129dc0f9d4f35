"""Tests of the Hydra configs in ``torchrec_herald/conf`` through Hydra's compose API."""

import itertools
from typing import List, Optional

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from torchrec_herald.data import build_data_source

CONFIG_MODULE = "torchrec_herald.conf"

GROUPS = {
    "data": ["synthetic", "criteo_tsv", "columnar"],
    "planner": ["stock", "table_wise", "row_wise", "herald"],
    "pipeline": ["sparse_dist", "base", "herald"],
    "optimizer": ["rowwise_adagrad", "sgd"],
}
PLANNER_MODE = {"stock": "default", "herald": "row_wise"}  # planner option -> planner.mode (others: its name)
PLANNER_NAME = {"herald": "herald"}  # planner option -> planner.name (others: the stock planner)


def load(overrides: Optional[List[str]] = None) -> DictConfig:
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="train", overrides=overrides or [])


def test_group_options_registered_are_the_tested_ones() -> None:
    """A new option registered in a group (``torchrec_herald.config.register_configs``) must be added to
    GROUPS (and so gets composed below)."""
    from hydra.core.config_store import ConfigStore

    import torchrec_herald.config  # noqa: F401  (registers the groups)

    repo = ConfigStore.instance().repo
    for group, options in GROUPS.items():
        registered = sorted(name[:-5] for name in repo[group] if name.endswith(".yaml"))
        assert registered == sorted(options), group


@pytest.mark.parametrize(
    "group, option", [(g, o) for g, options in GROUPS.items() for o in options]
)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = load([f"{group}={option}"])
    assert group in cfg
    # everything that is set resolves (??? values such as data.paths stay missing)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    node = cfg[group]
    if group == "planner":  # stock planner in some mode, or HeraldPlanner (cold rows row-wise)
        assert node.name == PLANNER_NAME.get(option, "stock")
        assert node.mode == PLANNER_MODE.get(option, option)
    else:
        assert node.name == option


def test_all_group_combinations_compose() -> None:
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        for combo in itertools.product(*GROUPS.values()):
            overrides = [f"{g}={o}" for g, o in zip(GROUPS, combo)]
            cfg = compose(config_name="train", overrides=overrides)
            for g, o in zip(GROUPS, combo):
                assert (cfg[g].mode if g == "planner" else cfg[g].name) == (PLANNER_MODE.get(o, o) if g == "planner" else o)


def test_defaults() -> None:
    cfg = load()
    assert cfg.data.name == "synthetic"
    assert cfg.planner.name == "stock"
    assert cfg.planner.mode == "default"
    assert cfg.optimizer.name == "rowwise_adagrad"
    assert cfg.pipeline.name == "sparse_dist"
    assert cfg.batch_size == 256
    assert cfg.epochs == 1
    assert cfg.eval is True
    assert not OmegaConf.missing_keys(cfg)  # the default config runs as is


def test_dense_arch_ends_with_embedding_dim() -> None:
    cfg = load()
    assert cfg.model.dense_arch[-1] == cfg.model.embedding_dim
    assert cfg.model.over_arch[-1] == 1


def test_overrides_apply() -> None:
    cfg = load(["batch_size=64", "data.num_train_batches=8", "planner=row_wise", "optimizer.lr=0.5"])
    assert cfg.batch_size == 64
    assert cfg.data.num_train_batches == 8
    assert cfg.planner.mode == "row_wise"
    assert cfg.optimizer.lr == 0.5


@pytest.mark.parametrize("key", ["foo", "data.foo", "data.num_train_batches_typo"])
def test_unknown_key_is_rejected(key: str) -> None:
    with pytest.raises(ConfigCompositionException) as e:
        load([f"{key}=1"])
    msg = str(e.value) + str(e.value.__cause__ or "")
    assert key.split(".")[-1] in msg


def test_unknown_top_key_message() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        load(["foo=1"])
    assert "Key 'foo' not in 'TrainConfig'" in str(e.value) + str(e.value.__cause__ or "")


def test_key_of_other_data_source_is_rejected() -> None:
    """criteo_tsv has no num_train_batches (synthetic only)."""
    with pytest.raises(ConfigCompositionException, match="num_train_batches"):
        load(["data=criteo_tsv", "data.num_train_batches=8"])


@pytest.mark.parametrize("group", list(GROUPS))
def test_unknown_group_option_is_rejected(group: str) -> None:
    with pytest.raises(MissingConfigException) as e:
        load([f"{group}=bogus"])
    assert f"Could not find '{group}/bogus'" in str(e.value)


def test_default_data_source_has_26_features() -> None:
    cfg = load()
    src = build_data_source(cfg.data)
    assert len(src.feature_names) == 26
    assert len(src.num_embeddings) == 26
    assert src.num_dense == 13


def test_file_sources_need_paths() -> None:
    for option in ("criteo_tsv", "columnar"):
        cfg = load([f"data={option}"])
        assert "data.paths" in OmegaConf.missing_keys(cfg)
        with pytest.raises(ValueError, match="mandatory value missing"):
            build_data_source(cfg.data)


@pytest.mark.parametrize("group, option, build", [
    ("pipeline", "herald", "torchrec_herald.pipeline.options:HeraldPipelineConfig"),
    ("planner", "herald", "torchrec_herald.planner.config:HeraldPlannerConfig"),
    ("planner", "stock", "torchrec_herald.planner.config:StockPlannerConfig"),
    ("data", "synthetic", "torchrec_herald.data.config:SyntheticDataConfig"),
    ("model", "dlrm", "torchrec_herald.config:ModelConfig"),
    ("optimizer", "rowwise_adagrad", "torchrec_herald.config:OptimizerConfig"),
])
def test_the_python_api_and_the_command_line_start_from_the_same_defaults(group: str, option: str,
                                                                         build: str) -> None:
    """One source of defaults: the group's dataclass built in Python with no argument equals the option
    the command line composes (and the data source / planner / pipeline built from either is the same)."""
    import dataclasses
    import importlib

    module, name = build.split(":")
    in_python = getattr(importlib.import_module(module), name)()
    from_yaml = OmegaConf.to_object(load([f"{group}={option}"])[group])
    assert dataclasses.asdict(from_yaml) == dataclasses.asdict(in_python)
    assert type(from_yaml) is type(in_python)


def test_herald_pipeline_defaults_resolve_alike_from_python_and_the_command_line() -> None:
    """The pipeline's data-dependent defaults (``global_batches``, ``run_ahead``, ``scheduling=auto``)
    are decided by the same rule for both: whole global batches, running ahead and the probe for the
    trainer's seekable stream (with stale-update skipping too); per-rank batches, scheduled ahead, and
    scheduling on for a loader of the rank's own batches; the plan stays on for bounded staleness."""
    from torchrec_herald.pipeline.options import HeraldPipelineConfig
    from torchrec_herald.pipeline.stale_skip import SkipConfig

    def decided(c: HeraldPipelineConfig, whole: bool) -> tuple:
        r, _ = c.resolve(whole_batches=whole, world_size=2)
        return r.global_batches, r.run_ahead, r.scheduling

    for python, cli in ((HeraldPipelineConfig(), []),
                        (HeraldPipelineConfig(skip=SkipConfig("input")), ["pipeline.skip=input"]),
                        (HeraldPipelineConfig(staleness=1), ["pipeline.staleness=1"])):
        yaml = OmegaConf.to_object(load(["planner=herald", "pipeline=herald", *cli]).pipeline)
        for whole in (True, False):
            assert decided(python, whole) == decided(yaml, whole)
    assert decided(HeraldPipelineConfig(), True) == (True, True, "auto")
    assert decided(HeraldPipelineConfig(), False) == (False, True, "on")
    assert decided(HeraldPipelineConfig(skip=SkipConfig("input")), True) == (True, True, "auto")
    assert decided(HeraldPipelineConfig(staleness=1), True) == (True, True, "on")
    assert decided(HeraldPipelineConfig(global_batches=True), False) == (True, True, "auto")  # the caller says so


def test_every_data_option_has_a_source_and_every_source_an_option() -> None:
    """``data=<option>`` (its config class) and the source built from it are registered in two tables (the
    configs import no source module): they must name the same options."""
    from torchrec_herald.data import base
    from torchrec_herald.data.config import DATA_CONFIGS

    assert set(DATA_CONFIGS) == set(base._SOURCES)
