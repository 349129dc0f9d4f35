"""The training config, typed: one dataclass per config group, each validating itself, registered in
Hydra's ``ConfigStore`` as the groups' options. The command line (``python -m torchrec_herald.train``,
``conf/train.yaml``'s defaults list) and the Python API therefore start from the same defaults, the
dataclasses'.

Groups and their options:

========== ============================================ ==============================================
group      options                                      dataclass
========== ============================================ ==============================================
data       synthetic (default), criteo_tsv, columnar    ``torchrec_herald.data.config``
model      dlrm                                         :class:`ModelConfig`
planner    stock (default), table_wise, row_wise,       ``torchrec_herald.planner.config``
           herald
pipeline   sparse_dist (default), base, herald          :class:`TorchRecPipelineConfig`,
                                                        ``HeraldPipelineConfig``
optimizer  rowwise_adagrad (default), sgd               :class:`OptimizerConfig`
========== ============================================ ==============================================

:func:`validate` turns a composed config into these objects, which raises the first bad value's
error naming its key; :func:`compose_config` composes one outside ``@hydra.main``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from torchrec_herald.data.config import DATA_CONFIGS
from torchrec_herald.pipeline.options import HeraldPipelineConfig
from torchrec_herald.planner.config import HeraldPlannerConfig, StockPlannerConfig

__all__ = ["CheckpointConfig", "ModelConfig", "OPTIMIZER_NAMES", "OptimizerConfig", "TORCHREC_PIPELINES",
           "TorchRecPipelineConfig", "TrainConfig", "compose_config", "register_configs", "validate"]

#: ``optimizer.name`` values: fused EXACT_ROWWISE_ADAGRAD + dense Adagrad, fused EXACT_SGD + SGD
OPTIMIZER_NAMES = ("rowwise_adagrad", "sgd")
#: ``pipeline=`` options that are TorchRec's own pipelines
TORCHREC_PIPELINES = ("sparse_dist", "base")


@dataclass
class ModelConfig:
    """TorchRec's DLRM over one EmbeddingBagCollection table per sparse feature."""

    embedding_dim: int = 16
    dense_arch: List[int] = field(default_factory=lambda: [64, 16])  # must end with embedding_dim
    over_arch: List[int] = field(default_factory=lambda: [64, 32, 1])
    pooling: str = "SUM"  # SUM | MEAN

    def __post_init__(self) -> None:
        if str(self.pooling).upper() not in ("SUM", "MEAN"):
            raise ValueError(f"model.pooling must be SUM or MEAN, got {self.pooling!r}")
        if int(self.embedding_dim) < 1 or int(self.embedding_dim) % 4:
            raise ValueError(f"model.embedding_dim must be a positive multiple of 4 (fbgemm's TBE kernels), got "
                             f"{self.embedding_dim}")
        for key, sizes in (("dense_arch", list(self.dense_arch)), ("over_arch", list(self.over_arch))):
            if not sizes or min(sizes) < 1:
                raise ValueError(f"model.{key} must be a non-empty list of layer sizes >= 1, got {sizes}")
        if list(self.dense_arch)[-1] != self.embedding_dim:
            raise ValueError(f"model.dense_arch must end with model.embedding_dim={self.embedding_dim}, "
                             f"got {list(self.dense_arch)}")
        if len(self.over_arch) < 2 or list(self.over_arch)[-1] != 1:
            raise ValueError(f"model.over_arch must have at least two layers and end with 1 (the click logit), got "
                             f"{list(self.over_arch)}")


@dataclass
class OptimizerConfig:
    """The embedding optimizer (fused into TorchRec's TBE backward by ``apply_optimizer_in_backward``) and
    the dense one: ``rowwise_adagrad`` (RowWiseAdagrad + Adagrad) or ``sgd`` (SGD + SGD)."""

    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1.0e-08  # row-wise Adagrad's; unused by SGD
    dense_lr: float = 0.05

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown optimizer.name {self.name!r}; expected one of {sorted(OPTIMIZER_NAMES)}")
        for key, positive in (("lr", True), ("dense_lr", True), ("eps", False)):
            v = float(getattr(self, key))
            if not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise ValueError(f"optimizer.{key} must be a finite number {'> 0' if positive else '>= 0'}, got {v}")


@dataclass
class TorchRecPipelineConfig:
    """TorchRec's ``TrainPipelineSparseDist`` (``sparse_dist``: batch i+1's input dist overlaps step i) or
    ``TrainPipelineBase`` (``base``: forward, backward, step)."""

    name: str = "sparse_dist"

    def __post_init__(self) -> None:
        if self.name not in TORCHREC_PIPELINES:  # (pipeline.name=herald under pipeline=sparse_dist, say)
            known = self.name == "herald"
            raise ValueError(f"{'' if known else 'unknown '}pipeline.name {self.name!r} where this pipeline option's is "
                             f"one of TorchRec's {sorted(TORCHREC_PIPELINES)}: the option sets it; pick the pipeline "
                             f"with pipeline=<option> (pipeline=herald, pipeline=sparse_dist, pipeline=base)")


@dataclass
class CheckpointConfig:
    """``torch.distributed.checkpoint`` saves; re-running the same command resumes from the latest
    complete one (``torchrec_herald/run_identity.py`` names the run's folder)."""

    every_n_steps: Optional[int] = None  # null: no checkpoints; n >= 1: save every n steps and at the end
    dir: Optional[str] = None  # null: <root>/<run name>
    root: str = "outputs/checkpoints"
    resume: bool = True  # false: start fresh (the run's earlier checkpoints are moved aside, not deleted)
    keep: int = 2  # newest checkpoints kept

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and int(self.every_n_steps) < 1:
            raise ValueError(f"checkpoint.every_n_steps must be >= 1 (or null: no checkpoints), got {self.every_n_steps}")
        if int(self.keep) < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass
class TrainConfig:
    """The whole run (``python -m torchrec_herald.train``): the groups and the top-level keys."""

    data: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    planner: Any = MISSING
    pipeline: Any = MISSING
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch_size: int = 256  # local (per-rank) batch size
    epochs: int = 1
    seed: int = 0  # model init seed (data has its own data.seed)
    eval: bool = True  # AUC/logloss on the held-out split after training
    log_every: int = 50
    compare_with: Optional[str] = None  # a planner option trained on the same batches, printed beside
    # compare_with: the baseline and the run train in turns of this many steps in the same ranks, both models held
    # (a host's speed drifting over the job slows both alike); 0: the baseline in full first, then the run
    compare_turn_steps: int = 100
    run_name: Optional[str] = None  # names the run's checkpoint folder; null: derived from the config
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for key in ("batch_size", "epochs", "log_every"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if isinstance(self.compare_turn_steps, bool) or not isinstance(self.compare_turn_steps, int) \
                or self.compare_turn_steps < 0:
            raise ValueError(f"compare_turn_steps must be a whole number of steps >= 0 (0: the baseline trains in "
                             f"full first), got {self.compare_turn_steps!r}")
        planners = sorted(_group_options()["planner"])
        if self.compare_with is not None and self.compare_with not in planners:
            raise ValueError(f"compare_with={self.compare_with!r} is not a planner option; one of {planners}")
        herald_pipeline = isinstance(self.pipeline, HeraldPipelineConfig)
        if herald_pipeline and not isinstance(self.planner, HeraldPlannerConfig):
            mode = getattr(self.planner, "mode", "default")  # (planner=table_wise is the stock planner's mode)
            raise ValueError(f"pipeline=herald needs planner=herald (its embeddings must be herald-sharded); "
                             f"got planner={'stock' if mode == 'default' else mode}")
        if self.checkpoint.every_n_steps is not None and herald_pipeline and self.pipeline.approximate:
            raise ValueError("checkpoint.every_n_steps with pipeline.staleness / pipeline.skip is not supported "
                             "(their state is not checkpointed); use the exact herald pipeline")


def _group_options() -> Dict[str, Dict[str, type]]:
    """Each config group's options and the dataclass of each (what :func:`register_configs` stores)."""
    return {"data": dict(DATA_CONFIGS),
            "planner": {"stock": StockPlannerConfig, "table_wise": StockPlannerConfig, "row_wise": StockPlannerConfig,
                        "herald": HeraldPlannerConfig},
            "pipeline": {**{name: TorchRecPipelineConfig for name in TORCHREC_PIPELINES}, "herald": HeraldPipelineConfig}}


def key_of_another_option(dotted: str) -> Optional[str]:
    """For ``group.key`` where ``key`` is a setting of some of ``group``'s options (``pipeline.window`` of
    ``pipeline=herald``), the line that says so; else None. Hydra's own message for such a key asks for ``+``,
    which then fails as an unknown key."""
    group, _, key = dotted.partition(".")
    if "." in key:  # (a key nested under a setting: the setting's own option is chosen already, or Hydra says)
        return None
    options = _group_options().get(group, {})
    having = [name for name, cls in options.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if not key or not having:
        return None
    return (f"{group}.{key} is a setting of {' / '.join(f'{group}={n}' for n in having)}: choose that option "
            f"({group}={having[0]}) with it")


def register_configs() -> None:
    """Put every group option into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, cls in DATA_CONFIGS.items():
        cs.store(group="data", name=name, node=cls)
    cs.store(group="model", name="dlrm", node=ModelConfig)
    cs.store(group="planner", name="stock", node=StockPlannerConfig(mode="default"))
    cs.store(group="planner", name="table_wise", node=StockPlannerConfig(mode="table_wise"))
    cs.store(group="planner", name="row_wise", node=StockPlannerConfig(mode="row_wise"))
    cs.store(group="planner", name="herald", node=HeraldPlannerConfig)
    for name in TORCHREC_PIPELINES:
        cs.store(group="pipeline", name=name, node=TorchRecPipelineConfig(name=name))
    cs.store(group="pipeline", name="herald", node=HeraldPipelineConfig)
    cs.store(group="optimizer", name="rowwise_adagrad", node=OptimizerConfig())
    cs.store(group="optimizer", name="sgd", node=OptimizerConfig(name="sgd", lr=0.1, dense_lr=0.1))


register_configs()


def validate(cfg: DictConfig) -> TrainConfig:
    """The composed config as typed objects: every group's dataclass validates its values and the run
    its cross-group rules; the first bad value raises ValueError naming its key."""
    from omegaconf.errors import MissingMandatoryValue

    _check_keys(cfg)
    try:
        typed = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ValueError(f"mandatory value missing (???): {e.full_key} (set it on the command line)") from None
    assert isinstance(typed, TrainConfig), type(typed)
    return typed


def _check_keys(node: DictConfig, path: str = "") -> None:
    """Every key of each typed group is one of its dataclass's fields, and none is missing: a key added with
    ``+`` (a typo: ``+pipeline.stalenes=1``) would be ignored silently, and one deleted with ``~`` read by
    the trainer after the typed check had filled in its default. ValueError naming the key."""
    kind = OmegaConf.get_type(node)
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return  # (a free-form mapping, e.g. data.sparse)
    fields = [f.name for f in dataclasses.fields(kind)]
    keys = list(node.keys())
    extra = [str(k) for k in keys if k not in fields]
    if extra:
        elsewhere = key_of_another_option(f"{path}{extra[0]}") if path.count(".") == 1 else None
        raise ValueError(f"unknown key {path}{extra[0]}: {path.rstrip('.') or 'the config'} has no such key (known: "
                         f"{', '.join(sorted(fields))})" + (f"; {elsewhere}" if elsewhere else ""))
    deleted = [f for f in fields if f not in keys]
    if deleted:
        raise ValueError(f"{path}{deleted[0]} was deleted (~{path}{deleted[0]}): every key has a default; set it "
                         f"instead")
    for k in keys:
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not child._is_none():
            _check_keys(child, f"{path}{k}.")


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/train.yaml`` with Hydra overrides applied, exactly as ``python -m torchrec_herald.train`` sees it."""
    with initialize_config_module("torchrec_herald.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))
