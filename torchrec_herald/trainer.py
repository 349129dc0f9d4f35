"""The training run behind ``python -m torchrec_herald.train``, in torchtitan's shape: a :class:`Trainer` is
built from one validated config (``Trainer(cfg, run_dir).build()``: data → DLRM on ``meta`` → the planner's
decision → DMP → the train pipeline → checkpoints) and then trains (``.train()`` → the metrics). ``compare_with``'s
two runs train in turns in the same ranks (:func:`train_in_turns`), each measuring its own turns.

The driver, the tests and the benchmarks run the very same code. Every rank fills only its shards from a
deterministic per-row initialisation, so every plan starts from identical weights and stock and herald
runs are comparable step by step. The trainer drives any pipeline through one narrow interface
(``pipeline/build.py``); what a run measured is assembled by ``metrics.py`` and shown by ``report.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer
from tqdm import tqdm

from torchrec_herald.comm import row_with_state_bytes
from torchrec_herald.config import OPTIMIZER_NAMES, CheckpointConfig
from torchrec_herald.data import DataSource, TrainStream, build_data_source
from torchrec_herald.dist_utils import comm_unseen_by_host, init_distributed, rank0_outcome
from torchrec_herald.layout import check_cache_budget
from torchrec_herald.metrics import collect_metrics, evaluate, herald_traffic_report, strict_json
from torchrec_herald.model import build_dlrm_train, build_tables
from torchrec_herald.pipeline.build import PIPELINES, TrainingPipeline
from torchrec_herald.pipeline.build import build_pipeline as build_configured_pipeline
from torchrec_herald.pipeline.options import HeraldPipelineConfig
from torchrec_herald.planner.config import INPUT_DIST_THREAD, HeraldPlannerConfig
from torchrec_herald.planner.decision import plan_model
from torchrec_herald.planner.types import PlanDecision
from torchrec_herald.planner.stock import describe_plan
from torchrec_herald.report import (embedding_bytes_per_step, format_comparison_table,  # noqa: F401  (re-exported)
                                    format_metrics_table, headline, plan_summary, plot_training)
from torchrec_herald.row_init import init_sharded_embeddings
from torchrec_herald.sharding.dense_sync import dense_optimizer_for, dense_sync_wrapper
from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection
from torchrec_herald.traffic import (MeteredDataParallelWrapper, TrafficMeter, clock_offsets, measured_peer_wait,
                                     reduce_summaries)

logger = logging.getLogger(__name__)

#: optimizer.name -> (fused embedding optimizer class for apply_optimizer_in_backward, dense optimizer)
OPTIMIZERS: Dict[str, tuple[type, type]] = {
    "rowwise_adagrad": (RowWiseAdagrad, torch.optim.Adagrad),  # fused: EXACT_ROWWISE_ADAGRAD
    "sgd": (torch.optim.SGD, torch.optim.SGD),  # fused: EXACT_SGD
}
assert set(OPTIMIZERS) == set(OPTIMIZER_NAMES), "config.OPTIMIZER_NAMES (what validates) and OPTIMIZERS must agree"


class _ConsoleFilter(logging.Filter):
    """The console shows this package's INFO on rank 0 and everyone's warnings (errors only from the other
    ranks); libraries' INFO chatter goes to the rank's log file only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= (logging.WARNING if self.rank == 0 else logging.ERROR)
                or (self.rank == 0 and record.name.startswith("torchrec_herald")))


class _ConsoleHandler(logging.StreamHandler):
    """stderr through ``tqdm.write``: a log line above the progress bar, never glued to its line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


class _HeldRecords(logging.Handler):
    """Keeps the records logged before a run's folder is known (its checks run before its folder is made, and a
    folder made for the logs would be one the checks find), for :func:`setup_logging` to write into the run's file."""

    LIMIT = 10_000

    def __init__(self) -> None:
        super().__init__()
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.LIMIT:
            self.records.append(record)


_HELD = _HeldRecords()


def _log_format(rank: int) -> str:
    return f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def _configure_logging(rank: int, log_file: Optional[Path]) -> None:
    import logging.config

    fmt = _log_format(rank)
    quiet = ("torchrec.distributed.planner", "torchrec.distributed.utils", "torchrec.distributed.train_pipeline",
             "torchrec.distributed.embeddingbag",
             "torch.fx._symbolic_trace")  # (TorchRec's is_fx_tracing() calls: a note to torch's developers, per rank)
    to_file: Dict[str, Any] = ({"class": "logging.FileHandler", "filename": str(log_file), "formatter": "rank"}
                               if log_file is not None else {"()": lambda: _HELD})
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"rank": {"format": fmt}},
        "filters": {"console": {"()": _ConsoleFilter, "rank": rank}},
        "handlers": {"file": to_file,
                     "console": {"()": _ConsoleHandler, "stream": "ext://sys.stderr", "formatter": "rank",
                                 "filters": ["console"]}},
        "root": {"level": "INFO", "handlers": ["file", "console"]},
        "loggers": {"py.warnings": {"handlers": ["file"], "propagate": False},
                    **{name: {"level": "ERROR"} for name in quiet}},
    })
    logging.captureWarnings(True)


def hold_logs(rank: Optional[int] = None) -> None:
    """Until :func:`setup_logging` names a run folder: the console as usual (rank 0's INFO and warnings, the other
    ranks' errors), and each record held for that folder's log file (a run's checks log before its folder exists)."""
    _configure_logging(_this_rank() if rank is None else rank, None)


def release_held_logs(run_dir: Path) -> None:
    """Append what :func:`hold_logs` held to ``run_dir``'s log file, and hold nothing more: a run that failed before
    its log was set up (its lines were left for the next run in the process, and its folder explained nothing)."""
    held, _HELD.records = _HELD.records, []
    if not held:
        return
    rank = _this_rank()
    form = logging.Formatter(_log_format(rank))
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "logs" / f"rank{rank}.log", "a") as f:
            f.writelines(form.format(r) + "\n" for r in held)
    except OSError:  # (a folder that takes no file: the console showed them)
        pass


def setup_logging(run_dir: Path, rank: Optional[int] = None) -> None:
    """Each rank logs to ``run_dir/logs/rank<r>.log`` (beginning with what :func:`hold_logs` held); rank 0 also logs
    INFO to stderr; library ``UserWarning`` s go to the rank's log file, not the console."""
    rank = _this_rank() if rank is None else rank
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    _configure_logging(rank, log_dir / f"rank{rank}.log")
    held, _HELD.records = _HELD.records, []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            for record in held:
                handler.handle(record)


def embedding_optimizer_setup(model: nn.Module, cfg: DictConfig) -> type:
    """Fuse the embedding optimizer into TorchRec's TBE backward (``apply_optimizer_in_backward``);
    returns the dense optimizer class."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer.name {cfg.name!r}; expected one of {sorted(OPTIMIZERS)}")
    emb_cls, dense_cls = OPTIMIZERS[cfg.name]
    kwargs: Dict[str, Any] = {"lr": cfg.lr}
    if cfg.name == "rowwise_adagrad":
        kwargs["eps"] = cfg.eps
    ebc = model.model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(emb_cls, ebc.parameters(), kwargs)
    return dense_cls


def build_model_and_plan(cfg: DictConfig, data: DataSource, world_size: int, device: torch.device,
                         earlier: Optional[PlanDecision] = None
                         ) -> tuple[DistributedModelParallel, CombinedOptimizer, PlanDecision]:
    """Seeded DLRM with its tables on ``meta`` → the planner's decision (``planner/decision.py``) → DMP,
    which materialises only this rank's shards (and herald's replicas and caches); the shards are then
    filled by the deterministic per-row initialisation (:mod:`torchrec_herald.row_init`), so every plan
    starts from identical weights without a full copy of the model on any rank. ``earlier``: this job's decision
    for the same planner settings (:func:`~torchrec_herald.planner.decision.plan_model`: its link probe reused)."""
    tables = build_tables(data.feature_names, data.num_embeddings, cfg.model.embedding_dim, cfg.model.pooling)
    model = build_dlrm_train(tables, data.num_dense, cfg.model.dense_arch, cfg.model.over_arch,
                             seed=cfg.seed, device="meta")
    dense_cls = embedding_optimizer_setup(model, cfg.optimizer)
    planner_config = OmegaConf.to_object(cfg.planner)
    sample = ([b.sparse_features for b in itertools.islice(data.train_batches(0, 1, world_size * cfg.batch_size),
                                                           planner_config.stats_batches)]
              if isinstance(planner_config, HeraldPlannerConfig) else [])
    decision = plan_model(planner_config, model, tables, sample, world_size, cfg.batch_size, device, dist.group.WORLD,
                          earlier=earlier)
    wrapper = dense_sync_wrapper(decision.dense_sync)
    dmp = DistributedModelParallel(model, device=device, plan=decision.plan, sharders=decision.sharders,
                                   data_parallel_wrapper=wrapper or MeteredDataParallelWrapper(cfg.model.embedding_dim))
    init_sharded_embeddings(dmp, {t.name: t.num_embeddings for t in tables}, cfg.seed)
    if isinstance(planner_config, HeraldPlannerConfig):  # planner.input_dist_thread, on every herald EBC
        for m in dmp.modules():
            if isinstance(m, ShardedHeraldEmbeddingBagCollection):
                m.input_dist_in_thread = INPUT_DIST_THREAD[planner_config.input_dist_thread]

    dense_opt = dense_optimizer_for(dmp, lambda ps: dense_cls(ps, lr=cfg.optimizer.dense_lr))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt]), decision


def build_pipeline(cfg: DictConfig, dmp: nn.Module, optimizer: Any, device: torch.device,
                   decision: Optional[PlanDecision] = None) -> TrainingPipeline:
    """The configured train pipeline (``pipeline/build.py``) behind the trainer's one interface."""
    return build_configured_pipeline(OmegaConf.to_object(cfg.pipeline), dmp, optimizer, device,
                                     herald_sharded=decision is None or decision.herald)


def train_stream(data: DataSource, rank: int, world: int, batch_size: int, start: int = 0, keep: int = 0
                 ) -> TrainStream:
    """The train batches from global batch ``start``: this rank's slice of each global batch. The source
    is deterministic and seekable, so a herald pipeline that schedules whole global batches switches the
    stream to read them whole (and back to slices while its scheduling is off). ``keep``: the last batches kept
    for a rewind (a herald pipeline's window at a checkpoint)."""
    return TrainStream(data, rank, world, batch_size, start=start, whole=False, keep=keep)


def _world_size() -> int:
    """The live process group's size, else torchrun's ``$WORLD_SIZE``, else 1."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def preflight(cfg: DictConfig, world_size: Optional[int] = None) -> DataSource:
    """Every check of a run's config that needs no model, no process group and no training step: every
    group validates itself (``torchrec_herald.config.validate``), then what spans groups and the data:
    the checkpoint folder, the data source and its files, the look-ahead window against the data's
    batches (a file's records are counted up to the window; the rest of a file is checked as it is
    read) and the skipping windows against the run's length. Raises ValueError (a data file:
    DataFormatError / FileNotFoundError) with one line naming the key or file; ``python -m
    torchrec_herald.train`` runs it for the herald run and its baseline before either trains.
    ``world_size``: default the process group's size, else ``$WORLD_SIZE`` (torchrun sets it), else 1. Returns the
    data source."""
    from torchrec_herald.config import validate
    from torchrec_herald.run_identity import check_checkpoint_location, run_name

    world = int(_world_size() if world_size is None else world_size)
    typed = validate(cfg)
    run_name(cfg, world)  # run_name: a folder name
    check_checkpoint_location(cfg, world, writing=typed.checkpoint.every_n_steps is not None)
    check_resumable(cfg, world)
    for group in (typed.planner, typed.pipeline):
        for line in getattr(group, "not_applied", list)():
            logger.warning("%s", line)
    if isinstance(typed.planner, HeraldPlannerConfig):
        from torchrec_herald.planner.planner import check_hot_budget_fits
        from torchrec_herald.planner.topology import make_topology

        check_hot_budget_fits(typed.planner.hot_memory_budget_bytes, make_topology(world),
                              "planner.hot_memory_budget_bytes")
    data = build_data_source(cfg.data)
    if typed.eval:
        check_eval_held_out(data)
    check_tables_fit(data, typed.model.embedding_dim, world, str(cfg.data.name), typed.optimizer.name)
    data.check()
    # (where the planner prices one rank locally, the model of time trains stock TABLE_WISE with TorchRec's
    # pipeline: no window is filled)
    fills_window = isinstance(typed.pipeline, HeraldPipelineConfig) and not (
        isinstance(typed.planner, HeraldPlannerConfig) and typed.planner.prices_one_rank_locally(world))
    skip = typed.pipeline.skip_config if isinstance(typed.pipeline, HeraldPipelineConfig) else None
    # skipping's first measuring window must end inside the data (it silently never started where a file ended first)
    skip_needs = skip.start + skip.gap + 1 if skip is not None else 0
    # one count of the first global batches serves every check (a file source parses them to count); k of them with
    # every k-th held out for eval have passed the first held-out batch, check_something_to_evaluate's question
    holds_out = typed.eval and not getattr(data, "eval_paths", None) and getattr(data, "holdout_every", None)
    found = count_batches(data, world, typed.batch_size, max(typed.pipeline.window if fills_window else 1, skip_needs,
                                                             int(holds_out or 0)))
    check_something_to_train(data, world, typed.batch_size, found)
    if isinstance(typed.pipeline, HeraldPipelineConfig):
        total = getattr(data, "num_train_batches", None)
        steps = None if total is None else int(total) * typed.epochs
        if steps is None and found is not None and found * typed.epochs < skip_needs:
            steps = found * typed.epochs
        typed.pipeline.check_run_length(steps)
        if fills_window:
            check_window(data, typed.pipeline.window, world, typed.batch_size, found)
            resolved, _ = typed.pipeline.resolve(True, world)  # (its settings' rules: the window within the probe)
            if typed.pipeline.move_penalty is not None and resolved.allocator == "identity" != typed.pipeline.allocator:
                logger.warning("pipeline.move_penalty=%s is not applied: at %d ranks pipeline.planning=%s plans by "
                               "home, whose allocator moves no sample", typed.pipeline.move_penalty, world,
                               typed.pipeline.planning)
        if typed.pipeline.cache_bytes is not None:  # (every table may be herald's: one row each)
            check_cache_budget(typed.pipeline.cache_bytes, len(data.feature_names),
                               row_with_state_bytes(typed.model.embedding_dim))
        typed.pipeline.scheduler_impl_choice()  # scheduler_impl=compiled without a build: one line naming the key
    if typed.eval:
        check_something_to_evaluate(data, world, typed.batch_size)
    if (isinstance(typed.pipeline, HeraldPipelineConfig) and typed.pipeline.approximate
            and isinstance(typed.planner, HeraldPlannerConfig) and typed.planner.prices_one_rank_locally(world)):
        raise ValueError("pipeline.staleness / pipeline.skip at one rank: the model of time trains stock TABLE_WISE "
                         "there (no link to save on), so there is nothing to approximate; train at several ranks, "
                         "or set planner.link_mbit=null to train herald's plan whatever the link")
    return data


def check_resumable(cfg: DictConfig, world_size: int) -> None:
    """The checkpoint a run would resume from (its folder's latest complete one, unless
    ``checkpoint.resume=false``) was saved by this run's settings and ranks: ValueError naming what differs
    otherwise, before anything is built or trained (every rank reads the same files)."""
    from torchrec_herald.checkpoint import latest_checkpoint, none_usable
    from torchrec_herald.run_identity import checkpoint_dir, resume_problem, training_identity

    c = cfg.get("checkpoint") or {}
    if not bool(c.get("resume", CheckpointConfig.resume)):
        return
    folder = checkpoint_dir(cfg, world_size)
    latest = latest_checkpoint(folder, TRAINER_KEYS)
    if latest is None:
        unusable = none_usable(folder, TRAINER_KEYS)  # (they would be replaced by a run from step 0)
        if unusable:
            raise ValueError(unusable)
        return
    problem = resume_problem(saved_run(latest), training_identity(cfg, world_size), latest)
    if problem:
        raise ValueError(problem)


def saved_run(path: Path) -> Any:
    """The identity of the run that saved the checkpoint at ``path`` (its trainer state's ``run``), or None
    where an older version saved it."""
    from torchrec_herald.checkpoint import TRAINER_STATE

    return json.loads((Path(path) / TRAINER_STATE).read_text()).get("run")


#: what a CPU rank holds besides its tables and its data (torch, TorchRec, fbgemm, the model; 0.44 GiB measured at
#: scale 0.01, 2026-11-28), counted where the check caps the tables by the host's memory
RANK_RUNTIME_BYTES = 512 << 20

#: the config key that sizes each data source's tables
TABLE_SIZE_KEYS = {"columnar": "data.sparse.<column>", "criteo_tsv": "data.num_embeddings / data.scale",
                   "synthetic": "data.scale"}


def check_tables_fit(data: DataSource, embedding_dim: int, world_size: int, data_name: str,
                     optimizer: str = "rowwise_adagrad") -> None:
    """The embedding tables, with their optimizer state, fit in the memory TorchRec's ``Topology`` gives the ranks
    (HBM + DDR a rank, over every rank: no plan can hold more): ValueError naming the largest tables and the key that
    sizes them, where TorchRec's planner would fail with a line about shard storage that names neither."""
    from torchrec_herald.data.synthetic import host_memory_bytes
    from torchrec_herald.planner.topology import make_topology

    capacity = sum(d.storage.hbm + d.storage.ddr for d in make_topology(world_size).devices)
    where = f"the {world_size} rank(s)' {capacity / 2**30:,.0f} GiB (TorchRec's Topology: HBM + DDR a rank)"
    host = host_memory_bytes()
    # on CPUs the tables are in the hosts' memory, which a host's ranks share (the Topology's 128 GiB of DDR a rank let
    # tables past it through, to fail in the allocator or the OOM killer); counted where a launcher says a host's ranks
    if host and not torch.cuda.is_available() and ("LOCAL_WORLD_SIZE" in os.environ or world_size == 1):
        per_host = max(1, min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))  # (a launcher sets it)
        hosts = -(-world_size // per_host)
        # every rank holds a runtime (torch, TorchRec) and the synthetic data's generator besides its share of the
        # tables: the tables passed where they alone fitted, and the OOM killer ended a rank naming nothing
        own = RANK_RUNTIME_BYTES + getattr(data, "generator_bytes", 0)
        if hosts * host - world_size * own < capacity:
            capacity = hosts * host - world_size * own
            owner = "the hosts'" if hosts > 1 else "this host's"
            where = (f"the {capacity / 2**30:,.1f} GiB {owner} {hosts * host / 2**30:,.0f} GiB of memory leave(s) "
                     f"for tables beside {'their' if hosts > 1 else 'its'} {world_size} rank(s)' "
                     f"{own / 2**30:,.1f} GiB each (runtime"
                     f"{', data generator' if getattr(data, 'generator_bytes', 0) else ''})")
    sizes = sorted(zip(data.num_embeddings, data.feature_names), reverse=True)
    row = row_with_state_bytes(embedding_dim) if optimizer == "rowwise_adagrad" else 4 * embedding_dim  # (SGD: none)
    need = sum(n for n, _ in sizes) * row
    if need > capacity:
        largest = ", ".join(f"{name}: {n:,} rows" for n, name in sizes[:3])
        raise ValueError(f"the embedding tables need {need / 2**30:,.1f} GiB with their optimizer state at dim "
                         f"{embedding_dim} (largest {largest}; {TABLE_SIZE_KEYS.get(data_name, 'data.*')}), more than "
                         f"{where}: lower the tables' sizes or add ranks")


def check_not_the_run_folder(cfg: DictConfig, run_dir: Path) -> None:
    """The checkpoint folder is not the run's output folder, where the run writes its logs, metrics and plots (a
    re-run would find them among its checkpoints): ValueError naming both keys."""
    from torchrec_herald.run_identity import checkpoint_dir

    folder = checkpoint_dir(cfg, _world_size())
    if (cfg.get("checkpoint") or {}).get("every_n_steps") and folder.resolve() == Path(run_dir).resolve():
        raise ValueError(f"checkpoint.dir={folder} is the run's output folder (hydra.run.dir), where it writes its logs "
                         f"and metrics: give the checkpoints a folder of their own")


def count_batches(data: DataSource, world_size: int, batch_size: int, at_least: int) -> Optional[int]:
    """The global batches of ``world_size × batch_size`` samples the data holds, counted up to ``at_least`` (a
    source that states ``num_train_batches``: None, nothing read; a source that cannot count: None)."""
    if getattr(data, "num_train_batches", None) is not None:
        return None
    return data.count_train_batches(world_size, batch_size, at_least=max(1, int(at_least)))


def check_something_to_train(data: DataSource, world_size: int, batch_size: int, found: Optional[int]) -> None:
    """The data gives at least one full global batch to train: ValueError naming the key otherwise (it failed after
    the model was built and sharded). ``found``: :func:`count_batches`'s count, at least 1 asked."""
    total = getattr(data, "num_train_batches", None)
    if total is not None and int(total) == 0:
        raise ValueError("data.num_train_batches=0 leaves nothing to train; give at least 1")
    if total is None and found == 0:
        raise ValueError(f"{data.describe()} holds no full global batch of {world_size} × {batch_size} samples to "
                         f"train (data.paths); lower batch_size or give more data")


def check_eval_held_out(data: DataSource) -> None:
    """No eval file is a training file: ValueError naming it and both keys (its AUC scored rows the model trained
    on: 0.996 for a model of 50 steps)."""
    from torchrec_herald.data.files import files_in_both

    both = files_in_both(getattr(data, "paths", []), getattr(data, "eval_paths", []))
    if both:
        raise ValueError(f"{', '.join(both)} is in data.paths and in data.eval_paths: the eval would score rows the "
                         f"model trained on; give held-out files as data.eval_paths, or leave it out to hold out every "
                         f"data.holdout_every-th global batch of data.paths")


def check_something_to_evaluate(data: DataSource, world_size: int, batch_size: int) -> None:
    """The held-out split holds a sample to evaluate (``eval=true``): ValueError naming the keys otherwise (the run
    trained to its end, then reported an AUC of NaN)."""
    n = getattr(data, "num_eval_batches", None)
    if n is not None and int(n) == 0:
        raise ValueError("data.num_eval_batches=0 leaves nothing to evaluate; give at least 1, or eval=false")
    holds = getattr(data, "holds_eval_samples", None)
    if holds is not None and not holds(world_size, batch_size):
        k = data.holdout_every
        raise ValueError(f"{data.describe()} holds out no sample to evaluate: data.holdout_every={k} holds out every "
                         f"{k}th global batch of {world_size} × {batch_size} samples, and data.paths holds fewer than "
                         f"{k - 1} global batches and one sample; lower data.holdout_every, give data.eval_paths, or eval=false")


def check_window(data: DataSource, window: int, world_size: int, batch_size: int, found: Optional[int]) -> None:
    """``pipeline.window`` fits in one pass over the data: ValueError naming the key otherwise (a source
    that cannot count its batches, none here, is checked as it is read). Data with no batch at all is
    :func:`check_something_to_train`'s, which preflight runs first. ``found``: :func:`count_batches`'s count,
    at least ``window`` asked."""
    total = getattr(data, "num_train_batches", None)
    if total is not None:
        if window > int(total):
            raise ValueError(f"pipeline.window={window} is larger than the {int(total)} batch(es) the data "
                             f"loader has (data.num_train_batches); lower pipeline.window")
        return
    if found is not None and found < window:
        raise ValueError(f"pipeline.window={window} is larger than the {found} global batch(es) of {world_size} × "
                         f"{batch_size} samples that {data.describe()} holds (data.paths); lower pipeline.window")


def is_approximate(cfg: DictConfig) -> bool:
    """An opt-in approximate mode (bounded staleness or stale-update skipping) is configured."""
    return cfg.pipeline.name == "herald" and (cfg.pipeline.get("staleness") is not None
                                              or cfg.pipeline.get("skip") is not None)


def exact_reference_config(cfg: DictConfig) -> DictConfig:
    """The same run in herald's exact mode (no staleness, no skipping)."""
    from torchrec_herald.run_identity import companion_run

    ref = copy.deepcopy(cfg)  # keeps the typed (structured) nodes
    ref.pipeline.staleness = None
    ref.pipeline.skip = None
    for key, value in dataclasses.asdict(HeraldPipelineConfig()).items():  # (skipping's tuning has nothing to tune)
        if key.startswith("skip_"):
            ref.pipeline[key] = value
    companion_run(ref, "exact_reference")  # never the approximate run's checkpoints
    if cfg.pipeline.get("staleness") is not None:  # HET's run keeps its plan on: so does its reference
        ref.pipeline.scheduling = "on"
    return ref


#: what the trainer's every trainer_state.json holds (``run``, the saving run's identity, is absent from older ones)
TRAINER_KEYS = ("step", "epoch", "batch_in_epoch", "losses_by_rank", "rng", "pipeline")


class Checkpointing:
    """The trainer's checkpoints (``checkpoint.*``): every ``every_n_steps`` steps and at the run's end, a DCP save
    of the model, the optimizers and the position (epoch, batch, every rank's losses, RNG, herald's pipeline counters)
    into the run's own folder (:func:`~torchrec_herald.run_identity.checkpoint_dir`: derived from the
    config, so re-running the same command finds it); at start, a resume from its latest complete
    checkpoint (``checkpoint.resume``). A herald pipeline flushes and restarts its window at a save, in an
    uninterrupted run as in a resumed one, so both train the same batches the same way."""

    def __init__(self, cfg: DictConfig, dmp: nn.Module, optimizer: Any, pipeline: Any, world_size: int) -> None:
        from torchrec_herald.run_identity import checkpoint_dir, training_identity

        c = cfg.get("checkpoint") or {}
        self.every = c.get("every_n_steps")
        self.keep = int(c.get("keep") if c.get("keep") is not None else CheckpointConfig.keep)
        self.resume_enabled = bool(c.get("resume", CheckpointConfig.resume))
        self.dir = checkpoint_dir(cfg, world_size)
        self.identity = training_identity(cfg, world_size)  # recorded in every save, compared at a resume
        self.dmp, self.optimizer, self.pipeline = dmp, optimizer, pipeline
        self._lock_fd: Optional[int] = None

    def claim(self) -> None:
        """Make the checkpoint folder this run's while it trains (collective; rank 0 holds an exclusive lock on
        ``.<folder>.lock`` beside the folder's resolved path, which the system drops when the process ends): a
        second run given the same folder at the same time, by any path (``checkpoint.dir`` or ``run_name``), would
        overwrite its checkpoints, or move them aside. A run that saves none takes the lock only where it would move
        the folder aside (``checkpoint.resume=false``); one that resumes from it and saves nothing only reads it.
        ValueError on every rank naming the folder and the process that holds it. A run that saves then checks that
        every rank sees one folder there (:func:`~torchrec_herald.checkpoint.check_every_rank_shares`)."""
        if not self.every and self.resume_enabled:
            return
        from torchrec_herald.run_identity import UNGUARDED, exclusive_lock

        def lock() -> Optional[str]:  # (rank 0: its error line, or None)
            if not self.every and not self.dir.exists():  # (resume=false with nothing to move aside: no lock)
                return None
            try:
                real = self.dir.resolve()  # (one folder reached by two paths, a link or `..`, is one lock)
            except (OSError, RuntimeError):  # (a symlink loop: the path as given)
                real = self.dir.absolute()
            held = exclusive_lock(real.parent / f".{real.name}.lock", f"checkpoint folder {self.dir}")
            if isinstance(held, int):
                self._lock_fd = held
                return None
            if held == UNGUARDED:  # (a folder whose parent is not writable, a file system without locks: unguarded)
                return None
            return (f"checkpoint folder {self.dir} is in use by another run ({held}): give this run a folder of "
                    f"its own (checkpoint.dir or run_name), or re-run it once that one ends")

        error = rank0_outcome(lock)
        if error is not None:
            self.release()
            raise ValueError(error)
        if self.every:  # (ranks on hosts that each have a folder of this path would each save a part of a checkpoint)
            from torchrec_herald.checkpoint import check_every_rank_shares

            try:
                check_every_rank_shares(self.dir)
            except (ValueError, OSError):
                self.release()
                raise

    def release(self) -> None:
        """Let the checkpoint folder go (rank 0's lock; the end of :meth:`Trainer.train`, or of the process)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % int(self.every) == 0

    def resume(self) -> Optional[Dict[str, Any]]:
        """Load the run's latest complete checkpoint (collective; rank 0 picks it) and say so in one line;
        with ``checkpoint.resume=false`` move the folder's checkpoints aside (kept, renamed) and start
        fresh. Returns the checkpoint's trainer state (with ``path``), or None."""
        from torchrec_herald.checkpoint import (checkpoints, latest_checkpoint, load_checkpoint, none_usable, set_rng_state,
                                                shared_folder_problem, who_sees)

        choice: List[Any] = [None, None]  # (the checkpoint to resume or "", why it must not be resumed or None)
        if dist.get_rank() == 0:
            latest = latest_checkpoint(self.dir, TRAINER_KEYS)
            if not self.resume_enabled and checkpoints(self.dir):  # (usable or not: a save would replace them)
                aside = self.dir.with_name(f"{self.dir.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
                self.dir.rename(aside)
                logger.warning("checkpoint.resume=false: starting fresh; the earlier checkpoints of this run were "
                               "moved to %s", aside)
                latest = None
            if latest is not None and self.resume_enabled:
                latest = self._unless_an_end_without_figures(latest)
            choice[0] = str(latest or "")
            choice[1] = (self.problem(latest) if latest is not None else
                         none_usable(self.dir, TRAINER_KEYS) if self.resume_enabled else None)
        dist.broadcast_object_list(choice, src=0)
        if choice[1]:  # every rank raises it: none waits on a collective the others never reach
            raise ValueError(choice[1])
        if not choice[0]:
            if self.every:
                logger.info("checkpoints of this run: %s (every %d steps; re-running the same command resumes "
                            "from the latest)", self.dir, int(self.every))
            return None
        own = self.dir / Path(choice[0]).name  # (this rank's view of the checkpoint rank 0 picked)
        problem = shared_folder_problem(self.dir, who_sees(own / ".metadata"), f"the checkpoint {own.name}")
        if problem is not None:
            raise ValueError(problem)
        state = load_checkpoint(own, self.dmp, self.optimizer)
        set_rng_state(state["rng"])
        self.pipeline.load_state_dict(state["pipeline"])
        logger.warning("resuming from checkpoint %s: step %d (epoch %d, batch %d of it); checkpoint.resume=false "
                       "starts fresh", choice[0], state["step"], state["epoch"], state["batch_in_epoch"])
        return dict(state, path=choice[0])

    def _unless_an_end_without_figures(self, latest: Path) -> Path:
        """``latest``, unless it is a run's end (saved after its last step) whose figures are not beside it (the
        attempt ended between that save and writing them): then the newest complete checkpoint before it, whose
        resume trains the run's tail again, the same losses (one warning). Where there is none, ``latest``
        (:meth:`Trainer._already_complete` says how to train it again)."""
        from torchrec_herald.checkpoint import TRAINER_STATE, latest_checkpoint

        state = json.loads((latest / TRAINER_STATE).read_text())
        if not state.get("final"):
            return latest
        why = "were not written beside it (the attempt ended first)"
        try:
            metrics = self.completed_metrics()
        except ValueError:
            metrics, why = None, "beside it cannot be read"
        if metrics is not None and int(metrics.get("steps", -1)) == int(state["step"]):
            return latest
        earlier = latest_checkpoint(self.dir, TRAINER_KEYS, before=latest)
        if earlier is None:
            return latest
        logger.warning("checkpoint %s is the run's end, but its figures %s: resuming from %s to train the run's tail "
                       "again", latest, why, earlier)
        return earlier

    def problem(self, path: Path) -> Optional[str]:
        """Why the checkpoint at ``path`` is another run's (one line naming what differs), or None
        (:func:`~torchrec_herald.run_identity.resume_problem`)."""
        from torchrec_herald.run_identity import resume_problem

        saved = saved_run(path)
        if saved is None:
            logger.warning("checkpoint %s does not record the run that saved it (an older version's): resuming it "
                           "without comparing its settings with this run's", path)
        return resume_problem(saved, self.identity, Path(path))

    def completed_metrics(self) -> Optional[Dict[str, Any]]:
        """The metrics a run that already finished left in its checkpoint folder, or None; ValueError naming
        ``metrics.json`` or ``losses.json`` there where one cannot be read (written whole or not at all since
        2026-11-28: a full disk left an empty one)."""
        path = self.dir / "metrics.json"
        if not path.is_file():
            return None
        for name in ("metrics.json", "losses.json"):
            try:
                parsed = json.loads((self.dir / name).read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{self.dir / name}, the finished run's figures beside its checkpoints, cannot be "
                                 f"read ({type(e).__name__}: {e}); restore it (the run folder of the attempt that "
                                 f"finished holds a copy), or checkpoint.resume=false to train the run again") from e
            if name == "metrics.json":
                metrics = parsed
        return metrics

    def record_completion(self, run_dir: Path) -> None:
        """Rank 0: leave the finished run's ``metrics.json`` and ``losses.json`` beside its checkpoints (a
        re-run reports them instead of training nothing)."""
        from torchrec_herald.checkpoint import checkpoints

        if self.every and dist.get_rank() == 0 and checkpoints(self.dir):  # (beside checkpoints only: a folder the
            for name in ("metrics.json", "losses.json"):                     # run saved none into stays as it was)
                copy_whole(run_dir / name, self.dir / name)

    def mark_final(self, step: int) -> None:
        """Record that the periodic checkpoint of ``step`` is the run's end (collective)."""
        from torchrec_herald.checkpoint import mark_final

        mark_final(self.dir, step)

    def save(self, step: int, epoch: int, batch_in_epoch: int, losses: List[float], it: Iterator[Any],
             restart: Any, final: bool = False) -> Iterator[Any]:
        """Save (collective); returns the iterator to go on with (a herald pipeline's window restarts at
        the data position, from ``restart()``). ``final``: the run's end (after its last step)."""
        from torchrec_herald.checkpoint import rng_state, save_checkpoint

        if self.pipeline.prepare_checkpoint():
            it = restart()
        by_rank: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(by_rank, losses)
        state = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "losses_by_rank": by_rank, "rng": rng_state(),
                 "pipeline": self.pipeline.state_dict(), "run": self.identity, "final": final}
        save_checkpoint(self.dir, step, self.dmp, self.optimizer, state, self.keep)
        return it


def copy_whole(src: Path, dst: Path) -> None:
    """Copy the text file ``src`` to ``dst`` whole or not at all (:func:`~torchrec_herald.checkpoint.replace_whole`):
    a full disk or a kill midway leaves the earlier ``dst`` or none, never a truncated one that a re-run would read."""
    from torchrec_herald.checkpoint import replace_whole

    replace_whole(dst, src.read_text())


def write_whole(path: Path, text: str) -> None:
    """Write a run's figure file whole or not at all (a temporary file beside it, then a rename); OSError naming the
    file and the run folder's key where it cannot (a full disk left an empty ``losses.json`` and a line naming none)."""
    from torchrec_herald.checkpoint import replace_whole

    try:
        replace_whole(path, text)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path} ({e.strerror or e}): the run's figures go to its folder "
                               f"(hydra.run.dir); make room there or give another") from None


def fault_injection(step: int, rank: int) -> None:
    """Test hook: SIGKILL this rank after ``step`` when ``HERALD_FAULT_KILL_AT_STEP`` / ``_RANK`` say so,
    on a job's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), as a lost machine would end it."""
    at = os.environ.get("HERALD_FAULT_KILL_AT_STEP")
    if at is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if step == int(at) and rank == int(os.environ.get("HERALD_FAULT_KILL_RANK", "0")):
        logger.warning("fault injection: SIGKILL rank %d after step %d", rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass
class _RunProgress:
    """A run's training in progress (:meth:`Trainer._start` → :meth:`Trainer._advance` … → :meth:`Trainer._end`)."""

    losses: List[float] = dataclasses.field(default_factory=list)  # this rank's, every step (restored ones first)
    step_times: List[float] = dataclasses.field(default_factory=list)  # this attempt's steps, seconds
    epoch: int = 0
    batch_in_epoch: int = 0
    ended_at: Tuple[int, int] = (0, 0)  # (epoch, batch in epoch) where the last epoch trained ended
    it: Optional[TrainStream] = None  # this epoch's batches (None: the epoch has not begun)
    train_time: float = 0.0  # seconds in this run's own turns
    restored: int = 0  # steps trained by earlier attempts
    resumed: Optional[Dict[str, Any]] = None
    since: Any = None
    bar: Any = None
    meter: Optional[TrafficMeter] = None
    peer_wait_steps: int = 0  # this attempt's steps whose collectives' arrivals the meter recorded
    #: each rank's clock against rank 0's when the window closed (:func:`~torchrec_herald.traffic.clock_offsets`),
    #: None until then: across hosts two clocks drift apart over a run, so the window's calls are matched on the
    #: offsets of their own time, not of the run's end
    clock_offsets: Optional[List[float]] = None


#: the attempt's steps whose collectives' arrival times the trainer records, to measure each rank's wait for its
#: latest peer (``step_time_breakdown_ms.peer_wait``): (steps skipped first, steps recorded); two floats a collective
PEER_WAIT_WINDOW = (20, 200)


class Trainer:
    """One training run on every rank of the (already or newly) initialised process group.

    ``Trainer(cfg, run_dir).build()`` validates the config and builds everything (data, model, plan,
    DMP, pipeline, checkpoints); :meth:`train` trains, evaluates, and has rank 0 write
    ``run_dir/metrics.json``, ``losses.json`` and ``training.png``; it returns the metrics (the same on
    every rank). ``reference``: an approximate run's exact-mode metrics, recorded beside its own. ``earlier``: this
    job's decision for the same planner settings (an approximate run's first build): its link probe is reused.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, show_progress: bool = True,
                 reference: Optional[Dict[str, Any]] = None, data: Optional[DataSource] = None,
                 earlier: Optional[PlanDecision] = None) -> None:
        self.cfg, self.run_dir, self.show_progress, self.reference = cfg, Path(run_dir), show_progress, reference
        self._checked_data, self._earlier = data, earlier

    def build(self) -> "Trainer":
        cfg = self.cfg
        self.data = self._checked_data if self._checked_data is not None else preflight(cfg)
        self.rank, self.world, self.device = init_distributed()
        setup_logging(self.run_dir, self.rank)
        torch.manual_seed(cfg.seed)
        self.dmp, self.optimizer, self.decision = build_model_and_plan(cfg, self.data, self.world, self.device,
                                                                       self._earlier)
        self.plan = describe_plan(self.decision.plan)
        logger.info("world_size=%d local_batch=%d plan: %s", self.world, cfg.batch_size, plan_summary(self.plan))
        logger.debug("plan by table: %s", self.plan)
        self.pipeline = build_pipeline(cfg, self.dmp, self.optimizer, self.device, self.decision)
        self.checkpoints = Checkpointing(cfg, self.dmp, self.optimizer, self.pipeline, self.world)
        return self

    def _progress_label(self) -> str:
        """The progress bar's label: which of the job's runs trains (a compare_with baseline, an approximate run's
        exact reference, or the run itself)."""
        folder = self.run_dir.name
        if folder.startswith("baseline_"):
            return f"train {folder[len('baseline_'):]} (baseline)"
        if folder == "exact_reference":
            return "train exact reference"
        from torchrec_herald.run_identity import planner_name

        return f"train {planner_name(self.cfg)}"

    def _stream(self, start: int) -> TrainStream:
        # a herald pipeline reads its window ahead and, at a checkpoint, starts it again from the data's position:
        # the batches it read are kept for that (a file would be parsed from the pass's start at every save)
        saves = bool((self.cfg.get("checkpoint") or {}).get("every_n_steps"))
        keep = int(self.cfg.pipeline.window) + 2 if self.cfg.pipeline.name == "herald" and saves else 0
        return train_stream(self.data, self.rank, self.world, self.cfg.batch_size, start=start, keep=keep)

    def train(self) -> Dict[str, Any]:
        """Train (resuming the run's latest checkpoint), evaluate and write the figures; the run's checkpoint
        folder is this run's alone meanwhile (:meth:`Checkpointing.claim`)."""
        self.checkpoints.claim()
        try:
            return self._train()
        finally:
            self.checkpoints.release()

    def _train(self) -> Dict[str, Any]:
        run = self._start()
        self._advance(run)
        return self._end(run)

    def _start(self, bar_position: Optional[int] = None) -> "_RunProgress":
        """Resume the run's latest checkpoint (collective) and set its training up: the loop's state, its progress
        bar (at ``bar_position``: two runs trained in turns show two bars) and its traffic meter."""
        cfg, rank, pipeline, ckpt = self.cfg, self.rank, self.pipeline, self.checkpoints
        run = _RunProgress()
        resumed = ckpt.resume()
        if resumed is not None:
            run.losses = list(resumed["losses_by_rank"][rank])
            run.epoch, run.batch_in_epoch = int(resumed["epoch"]), int(resumed["batch_in_epoch"])
        run.resumed, run.restored = resumed, len(run.losses)  # (earlier attempts' steps: left out of the figures)
        run.since = pipeline.snapshot()
        pipeline.checkpoint_schedule(ckpt.due)  # (herald's run-ahead plans no step across a checkpoint)
        total_batches = getattr(self.data, "num_train_batches", None)
        run.bar = tqdm(total=(total_batches * cfg.epochs if total_batches else None), desc=self._progress_label(),
                       unit="step", disable=not (self.show_progress and rank == 0), dynamic_ncols=True,
                       file=sys.stderr, initial=len(run.losses), position=bar_position)
        run.meter = TrafficMeter(embedding_dim=cfg.model.embedding_dim)
        return run

    def _advance(self, run: "_RunProgress", steps: Optional[int] = None) -> bool:
        """Train up to ``steps`` more steps (all that are left: None); True once the run's last batch has trained.
        The time spent here is the run's training time (two runs trained in turns each count their own turns)."""
        cfg, rank, pipeline, ckpt = self.cfg, self.rank, self.pipeline, self.checkpoints
        losses, trained = run.losses, 0
        turn_start = time.perf_counter()
        try:
            while run.epoch < cfg.epochs:
                if run.it is None:
                    run.it = self._stream(run.batch_in_epoch)
                while steps is None or trained < steps:
                    self._read_clocks_once_the_window_closed(run)  # (outside any step's time)
                    t0 = time.perf_counter()
                    self._record_arrivals(run)
                    if ckpt.due(len(losses) + 1):  # a checkpoint after this step restarts a herald window
                        pipeline.checkpoint_after_next_step()
                    try:
                        with run.meter:
                            out = pipeline.progress(run.it)
                    except StopIteration:
                        run.meter.arrival_times = False
                        break
                    loss = out[0].item()
                    run.step_times.append(time.perf_counter() - t0)
                    run.peer_wait_steps += run.meter.arrival_times  # (a step that ran: the window's count)
                    run.meter.arrival_times = False
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"loss became {loss} at step {len(losses)} (epoch {run.epoch})")
                    losses.append(loss)
                    trained += 1
                    run.batch_in_epoch += 1
                    if ckpt.due(len(losses)):
                        batch_in_epoch = run.batch_in_epoch
                        run.it = ckpt.save(len(losses), run.epoch, batch_in_epoch, losses, run.it,
                                           lambda: run.it.rewind(batch_in_epoch))
                    fault_injection(len(losses), rank)
                    run.bar.update(1)
                    if len(losses) % cfg.log_every == 0:
                        # (this rank's samples: losses.json and the figures take the mean over ranks, at the end)
                        run.bar.set_postfix({f"rank {rank} loss (mean of {cfg.log_every})":
                                             f"{sum(losses[-cfg.log_every:]) / cfg.log_every:.4f}"})
                        logger.info("step %d loss %.5f (this rank's samples)", len(losses), loss)
                else:  # (this turn's steps trained, the epoch not over: another run's turn follows)
                    with run.meter:  # (the run-ahead job's collectives, and the wait for it, are this run's)
                        pipeline.end_turn()
                    return False
                run.ended_at = (run.epoch, run.batch_in_epoch)  # (the final save's position)
                run.epoch, run.batch_in_epoch, run.it = run.epoch + 1, 0, None
            return True
        finally:
            run.train_time += time.perf_counter() - turn_start

    def _record_arrivals(self, run: "_RunProgress") -> None:
        """Record this step's collectives' arrival times where it is in :data:`PEER_WAIT_WINDOW` (not over NCCL,
        whose waits never block the host)."""
        skip, count = PEER_WAIT_WINDOW
        run.meter.arrival_times = skip <= len(run.step_times) < skip + count and not comm_unseen_by_host()

    def _read_clocks_once_the_window_closed(self, run: "_RunProgress") -> None:
        """Once the :data:`PEER_WAIT_WINDOW` has closed, read each rank's clock against rank 0's (collective: every
        rank at the same step, between two steps, counted in no meter), for :func:`measured_peer_wait` at the run's
        end. A run that ends first reads them then."""
        skip, count = PEER_WAIT_WINDOW
        if len(run.step_times) == skip + count and run.clock_offsets is None and not comm_unseen_by_host():
            with TrafficMeter.counting_in([]):
                run.clock_offsets = clock_offsets()

    def _end(self, run: "_RunProgress") -> Dict[str, Any]:
        """After the last step: the final checkpoint, then the figures, the eval pass and the files (collective)."""
        ckpt, losses, resumed = self.checkpoints, run.losses, run.resumed
        bar = run.bar
        if bar.total is not None and bar.n < bar.total:  # (input skipping trains fewer steps than the data's batches:
            bar.total = bar.n                             # the finished run's bar ends full, not at 88 %)
            bar.refresh()
        bar.close()
        steps, attempt_steps = len(losses), len(losses) - run.restored
        if ckpt.every and attempt_steps and not ckpt.due(steps):  # (the model at the run's end, saved: a re-run
            # of the finished run reports it rather than training its tail again from the last periodic checkpoint)
            ckpt.save(steps, *run.ended_at, losses, iter(()), lambda: iter(()), final=True)
        elif ckpt.every and attempt_steps:  # (the last step's periodic save is the run's end: an attempt that ends
            ckpt.mark_final(steps)           # before writing its figures resumes the save before it)
        if attempt_steps == 0 and resumed is not None:
            return self._already_complete(resumed)
        if steps == 0:
            raise RuntimeError(f"no training step ran: {self.data.describe()} yielded no full global batch of "
                               f"{self.world} × {self.cfg.batch_size} samples (data.*, batch_size)")
        return self._finish(losses, run.step_times, run.meter, run.train_time, steps, attempt_steps, resumed,
                            run.since, run.peer_wait_steps, run.clock_offsets)

    def _evaluate(self) -> Dict[str, float]:
        """The eval pass (collective): every sample of the held-out split scored once (its last global batch padded)."""
        pads = "pad_tail" in inspect.signature(self.data.eval_batches).parameters  # (a source of one's own may
        batches = self.data.eval_batches(self.rank, self.world, self.cfg.batch_size,  # predate the argument)
                                         **({"pad_tail": True} if pads else {}))
        return evaluate(self.dmp, batches, self.device)

    def _already_complete(self, resumed: Dict[str, Any]) -> Dict[str, Any]:
        """A re-run whose latest checkpoint is the run's end: report the finished run's figures, left beside its
        checkpoints for that step, instead of figures over zero steps; the loaded model is evaluated again where
        the eval split changed or the last eval did not finish (a bad eval file, fixed). Without this step's
        figures (the attempt ended between its last checkpoint and its figures), say how to train it again. A
        checkpoint past this run's ``epochs`` or past its (now shorter) data is another run's end: ValueError naming
        the key, whether or not its figures are there."""
        from torchrec_herald.run_identity import eval_identity

        ckpt, rank, cfg, step = self.checkpoints, self.rank, self.cfg, int(resumed["step"])
        epoch, position = int(resumed["epoch"]), int(resumed["batch_in_epoch"])
        if epoch >= cfg.epochs:  # (a finished run's figures are another run's: more epochs than asked for)
            raise ValueError(f"epochs={cfg.epochs} ends before the checkpoint {resumed['path']} (step {step}, in "
                             f"epoch {epoch + 1}): give epochs >= {epoch + 1} to train the run on (or report it), or "
                             f"checkpoint.resume=false to train it again")
        found = self.data.count_train_batches(self.world, cfg.batch_size, at_least=position + 1)
        if found is not None and found < position:
            raise ValueError(f"{self.data.describe()} now holds {found} global batch(es) of {self.world} × "
                             f"{cfg.batch_size} samples, fewer than the checkpoint {resumed['path']} trained of it "
                             f"({position} in epoch {epoch + 1}): the data changed since (data.paths); give the "
                             f"run's data, or checkpoint.resume=false to train it again")
        metrics = ckpt.completed_metrics()
        dist.barrier()  # (every rank has read them before rank 0 may write them again below)
        if metrics is None or int(metrics.get("steps", -1)) != step:
            why = ("none were recorded" if metrics is None else
                   f"those there are of {metrics.get('steps')} steps, another attempt's")
            raise ValueError(f"the run is already complete at step {step} (checkpoint {resumed['path']}), but its "
                             f"training figures for that step are not beside it ({why}: the attempt ended after its "
                             f"last checkpoint); checkpoint.resume=false trains it again")
        config = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(config, dict)
        evaluated = bool(metrics.get("eval")) or not (metrics.get("config") or {}).get("eval", True)
        if not evaluated or eval_identity(metrics.get("config") or {}) != eval_identity(config):
            eval_metrics = self._evaluate() if cfg.eval else {}
            metrics = dict(metrics, eval=eval_metrics, config=config)
            metrics["summary"] = headline(metrics)
            if rank == 0:
                logger.warning("the run already finished at step %d (checkpoint %s); its model evaluated again on "
                               "this run's eval split, its training figures from %s", step, resumed["path"],
                               ckpt.dir / "metrics.json")
                write_whole(self.run_dir / "metrics.json", strict_json(metrics))
                write_whole(self.run_dir / "losses.json", (ckpt.dir / "losses.json").read_text())
                ckpt.record_completion(self.run_dir)
        elif rank == 0:
            logger.warning("the run already finished at step %d (checkpoint %s); reporting its figures from %s",
                           step, resumed["path"], ckpt.dir / "metrics.json")
            for name in ("metrics.json", "losses.json"):
                write_whole(self.run_dir / name, (ckpt.dir / name).read_text())
        dist.barrier()
        return metrics

    def _finish(self, losses: List[float], step_times: List[float], meter: TrafficMeter, train_time: float,
                steps: int, attempt_steps: int, resumed: Optional[Dict[str, Any]], since: Any,
                peer_wait_steps: int = 0, offsets: Optional[List[float]] = None) -> Dict[str, Any]:
        """Figures of this attempt (collectives, in the same order on every rank), the eval pass, the files."""
        cfg, rank, pipeline = self.cfg, self.rank, self.pipeline
        pipeline_report = pipeline.report(since, train_time / attempt_steps)
        if (pipeline_report.get("scheduling") or {}).get("why") and dist.get_rank() == 0:
            logger.info("%s", pipeline_report["scheduling"]["why"])  # (a run shorter than scheduling=auto's probe)
        approximate_own = pipeline.approximate_report(since)
        scheduler_s = pipeline.scheduler_seconds(since)
        traffic = reduce_summaries(meter.summary())
        traffic_tags = reduce_summaries(meter.tag_summary())
        peer_wait = None if comm_unseen_by_host() else measured_peer_wait(meter, peer_wait_steps, offsets=offsets)
        loss_t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(loss_t)
        loss_t /= self.world
        herald = herald_traffic_report(self.dmp, self.decision.plan, attempt_steps, measured=not pipeline.plan_mode)
        pipeline.detach()  # restore the forwards TrainPipelineSparseDist rewrote / flush herald's caches

        def figures(eval_metrics: Dict[str, float]) -> Dict[str, Any]:  # (collective)
            return collect_metrics(
                cfg, world=self.world, steps=steps, attempt_steps=attempt_steps,
                restored=steps - attempt_steps if resumed is not None else None,
                resumed_from=resumed["path"] if resumed is not None else None,
                checkpoint_dir=str(self.checkpoints.dir) if self.checkpoints.every else None, train_time=train_time,
                step_times=step_times, losses=loss_t, traffic=traffic, traffic_tags=traffic_tags,
                wait_s=meter.wait_s, scheduler_s=scheduler_s, pipeline_report=pipeline_report,
                peer_wait_ms_by_rank=peer_wait, peer_wait_steps=peer_wait_steps,
                approximate_own=approximate_own, dmp=self.dmp, decision=self.decision, plan=self.plan,
                eval_metrics=eval_metrics, data_stats=self.data.stats(), reference=self.reference, herald=herald)

        eval_metrics: Dict[str, float] = {}
        if cfg.eval:
            # the training figures first: an eval file is checked only as it is read, and a bad record found
            # there (every rank raises it) must not take the trained run's figures with it
            if rank == 0:
                write_whole(self.run_dir / "metrics.json", strict_json(figures({})))
                write_whole(self.run_dir / "losses.json", json.dumps(loss_t.tolist()))
                # beside the checkpoints too: a re-run after a failed eval evaluates them, not trains again
                self.checkpoints.record_completion(self.run_dir)
            else:
                figures({})
            try:
                eval_metrics = self._evaluate()
            except Exception:
                if rank == 0:
                    logger.error("evaluation failed after training; the training figures (no eval) are in %s",
                                 self.run_dir / "metrics.json")
                raise
        metrics = figures(eval_metrics)
        if rank == 0:
            write_whole(self.run_dir / "metrics.json", strict_json(metrics))
            write_whole(self.run_dir / "losses.json", json.dumps(loss_t.tolist()))
            plot_training(self.run_dir, loss_t.tolist(), metrics)
            logger.info("wrote %s", self.run_dir / "metrics.json")
            self.checkpoints.record_completion(self.run_dir)
        dist.barrier()
        return metrics


def run_training(cfg: DictConfig, run_dir: Path, show_progress: bool = True,
                 data: Optional[DataSource] = None) -> Dict[str, Any]:
    """``Trainer(cfg, run_dir).build().train()``. An approximate run (``pipeline.staleness`` /
    ``pipeline.skip``) with ``pipeline.reference`` first trains the exact mode on the same batches (into
    ``run_dir/exact_reference``) and records it and the deltas under ``metrics["approximate"]``. ``data``: what
    :func:`preflight` of this ``cfg`` returned, where the caller ran it (its warnings are not said twice)."""
    return _run_training(cfg, run_dir, show_progress, data)


def _run_training(cfg: DictConfig, run_dir: Path, show_progress: bool, data: Optional[DataSource],
                  earlier: Optional[PlanDecision] = None) -> Dict[str, Any]:
    """:func:`run_training`; ``earlier``: the approximate run's decision, for its exact reference."""
    return _built_trainer(cfg, run_dir, show_progress, data, earlier).train()


def train_in_turns(runs: Sequence[Tuple[DictConfig, Path, Optional[DataSource]]], turn_steps: int,
                   show_progress: bool = True) -> List[Dict[str, Any]]:
    """Train ``runs`` (each ``(cfg, run_dir, data)`` as :func:`run_training` takes them) in the same ranks, in
    turns of ``turn_steps`` steps, and return their metrics in order; each is then evaluated and writes its files
    as it would alone. ``compare_with``'s baseline and run train this way: a host whose speed drifts over a job
    (other work on its cores, its neighbours) slows both alike, where the run trained second met whatever the host
    did then (identical runs one after the other measured 0.89–1.23× each other on a 2-core host; identical runs of
    ``make run``'s in turns of 100 steps 0.99–1.07×). Each run's samples/s counts its own turns. At a turn's end a run's background work
    (herald's run-ahead scheduler) finishes inside its turn and traffic meter (:meth:`TrainingPipeline.end_turn`);
    what a step leaves in flight for the next (TorchRec's next input dist, herald's dense and hot-row sums) completes
    during the other run's first step, counted by the run that sent it. Every run's model is held at once
    (``compare_turn_steps=0`` trains them one after the other instead). An approximate run's exact reference trains
    alone before the turns begin (its samples/s is not from turns)."""
    if turn_steps < 1:
        raise ValueError(f"turn_steps must be >= 1, got {turn_steps}")
    trainers = [_built_trainer(cfg, Path(run_dir), show_progress, data) for cfg, run_dir, data in runs]
    claimed: List[Trainer] = []
    try:
        for t in trainers:
            t.checkpoints.claim()
            claimed.append(t)
        progress = []
        for position, t in enumerate(trainers):
            setup_logging(t.run_dir, t.rank)  # (each run's lines in its own folder's log)
            progress.append(t._start(bar_position=position))
        left = list(range(len(trainers)))
        while left:
            for i in list(left):
                setup_logging(trainers[i].run_dir, trainers[i].rank)
                # (the last run left trains to its end: no other run's turn comes between)
                if trainers[i]._advance(progress[i], turn_steps if len(left) > 1 else None):
                    left.remove(i)
        out = []
        for t, run in zip(trainers, progress):
            setup_logging(t.run_dir, t.rank)
            out.append(t._end(run))
        return out
    finally:
        for t in claimed:
            t.checkpoints.release()


def _built_trainer(cfg: DictConfig, run_dir: Path, show_progress: bool, data: Optional[DataSource],
                   earlier: Optional[PlanDecision] = None) -> "Trainer":
    """The run's :class:`Trainer`, built (an approximate run's exact reference trained first: :func:`run_training`)."""
    reference = None
    hold_logs()  # (the checks below log into this run's folder, once the run has one)
    try:
        if data is None:
            data = preflight(cfg)  # the approximate run's settings fail before its reference trains
    except BaseException:
        release_held_logs(Path(run_dir))
        raise
    try:
        check_not_the_run_folder(cfg, run_dir)
    except ValueError:
        _HELD.records = []  # (the console showed them; a log written there would be one more file among checkpoints)
        raise
    if is_approximate(cfg) and cfg.pipeline.get("reference", True):
        # the approximate run's plan and pipeline are built first, so that what they refuse (no hot rows to skip,
        # stock tables beside herald's) stops the job before its reference trains (it was refused after it had
        # trained in full); then released, so that the two models are never held at once
        # its decision's link probe is reused by the reference's build and the final one (one probe, one link)
        early = Trainer(cfg, run_dir, show_progress, None, data).build()
        earlier = early.decision
        pg = getattr(getattr(early.dmp, "dense_sync", None), "_pg", None)
        if pg is not None:  # (its dense sums' group: the final build makes its own)
            dist.destroy_process_group(pg)
        del early
        gc.collect()
        reference = _run_training(exact_reference_config(cfg), Path(run_dir) / "exact_reference", show_progress, None,
                                  earlier)
    return Trainer(cfg, run_dir, show_progress, reference, data, earlier).build()
