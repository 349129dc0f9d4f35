"""The training run behind ``python -m torchrec_herald.train``: data → DLRM → plan → DMP → pipeline → metrics.

Everything is built from one Hydra config (``conf/train.yaml`` and its groups), so the driver, the
tests and the benchmarks run the very same code. The model is built on ``meta`` and every rank fills only
its shards from a deterministic per-row initialisation, so every plan starts from identical weights and
stock and herald runs are comparable step by step.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist
from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer
from tqdm import tqdm

from torchrec_herald.data import DataSource, TrainStream, build_data_source
from torchrec_herald.dist_utils import init_distributed
from torchrec_herald.model import build_dlrm_train, build_tables
from torchrec_herald.row_init import init_sharded_embeddings
from torchrec_herald.pipeline import HeraldTrainPipeline
from torchrec_herald.pipeline.options import HeraldPipelineConfig
from torchrec_herald.report import embedding_bytes_per_step, headline  # noqa: F401  (re-exported)
from torchrec_herald.planner.config import HeraldPlannerConfig
from torchrec_herald.planner.decision import PlanDecision, plan_model
from torchrec_herald.planner.stock import describe_plan
from torchrec_herald.sharding.dense_sync import dense_optimizer_for, dense_sync_wrapper
from torchrec_herald.traffic import MeteredDataParallelWrapper, TrafficMeter, reduce_summaries

logger = logging.getLogger(__name__)

#: optimizer.name -> (fused embedding optimizer class for apply_optimizer_in_backward, dense optimizer)
OPTIMIZERS: Dict[str, tuple[type, type]] = {
    "rowwise_adagrad": (RowWiseAdagrad, torch.optim.Adagrad),  # fused: EXACT_ROWWISE_ADAGRAD
    "sgd": (torch.optim.SGD, torch.optim.SGD),  # fused: EXACT_SGD
}
PIPELINES = {"sparse_dist": TrainPipelineSparseDist, "base": TrainPipelineBase}


def setup_logging(run_dir: Path, rank: int) -> None:
    """Each rank logs to ``run_dir/logs/rank<r>.log``; rank 0 also logs INFO to stderr."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    fh = logging.FileHandler(log_dir / f"rank{rank}.log")
    fh.setFormatter(fmt)
    root.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setFormatter(fmt)
    # console: our INFO on rank 0, everyone's warnings; libraries' INFO chatter goes to the file only
    sh.addFilter(lambda r: r.levelno >= (logging.WARNING if rank == 0 else logging.ERROR)
                 or (rank == 0 and r.name.startswith("torchrec_herald")))
    root.addHandler(sh)
    logging.captureWarnings(True)  # library UserWarnings -> the rank's log file, not the console
    warn_log = logging.getLogger("py.warnings")
    warn_log.propagate = False
    warn_log.handlers = [fh]
    for noisy in ("torchrec.distributed.planner", "torchrec.distributed.utils",
                  "torchrec.distributed.train_pipeline", "torchrec.distributed.embeddingbag"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


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


def build_model_and_plan(cfg: DictConfig, data: DataSource, world_size: int, device: torch.device
                         ) -> tuple[DistributedModelParallel, CombinedOptimizer, PlanDecision]:
    """Seeded DLRM with its tables on ``meta`` → the planner's decision (``planner/decision.py``) → DMP,
    which materialises only this rank's shards (and herald's replicas and caches); the shards are then
    filled by the deterministic per-row initialisation (:mod:`torchrec_herald.row_init`), so every plan
    starts from identical weights without a full copy of the model on any rank."""
    tables = build_tables(data.feature_names, data.num_embeddings, cfg.model.embedding_dim, cfg.model.pooling)
    model = build_dlrm_train(tables, data.num_dense, cfg.model.dense_arch, cfg.model.over_arch,
                             seed=cfg.seed, device="meta")
    dense_cls = embedding_optimizer_setup(model, cfg.optimizer)
    planner_config = OmegaConf.to_object(cfg.planner)
    sample = ([b.sparse_features for b in itertools.islice(data.train_batches(0, 1, world_size * cfg.batch_size),
                                                           planner_config.stats_batches)]
              if isinstance(planner_config, HeraldPlannerConfig) else [])
    decision = plan_model(planner_config, model, tables, sample, world_size, cfg.batch_size, device, dist.group.WORLD)
    wrapper = dense_sync_wrapper(decision.dense_sync)
    dmp = DistributedModelParallel(model, device=device, plan=decision.plan, sharders=decision.sharders,
                                   data_parallel_wrapper=wrapper or MeteredDataParallelWrapper(cfg.model.embedding_dim))
    init_sharded_embeddings(dmp, {t.name: t.num_embeddings for t in tables}, cfg.seed)

    dense_opt = dense_optimizer_for(dmp, lambda ps: dense_cls(ps, lr=cfg.optimizer.dense_lr))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense_opt]), decision


def build_pipeline(cfg: DictConfig, dmp: nn.Module, optimizer: Any, device: torch.device,
                   decision: Optional[PlanDecision] = None) -> Any:
    """``pipeline.name``: ``sparse_dist`` / ``base`` (TorchRec's) or ``herald`` (HeraldTrainPipeline with
    the group's options, see :func:`herald_pipeline_config`)."""
    name = cfg.pipeline.name
    if name == "herald":
        if decision is not None and not decision.herald:
            # planner.link_mbit chose stock TABLE_WISE: there is nothing for herald's pipeline to schedule
            logger.info("pipeline=herald: the plan is stock TABLE_WISE (planner.link_mbit), training with "
                        "TorchRec's TrainPipelineSparseDist")
            return TrainPipelineSparseDist(dmp, optimizer, device)
        return HeraldTrainPipeline(dmp, optimizer, device, config=herald_pipeline_config(cfg))
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline.name {name!r}; expected one of {sorted(PIPELINES) + ['herald']}")
    return PIPELINES[name](dmp, optimizer, device)


def train_stream(data: DataSource, pipeline: Any, rank: int, world: int, batch_size: int,
                 start: int = 0) -> TrainStream:
    """The train batches ``pipeline`` consumes from global batch ``start``: whole global batches for a
    herald pipeline with ``global_batches`` (every rank reads them, the source is deterministic and
    seekable; the pipeline switches the stream to this rank's slices while its scheduling is off), else
    this rank's slice of each."""
    whole = isinstance(pipeline, HeraldTrainPipeline) and pipeline.global_batches
    return TrainStream(data, rank, world, batch_size, start=start, whole=whole)


def herald_pipeline_config(cfg: DictConfig) -> HeraldPipelineConfig:
    """The ``pipeline=herald`` group as a validated :class:`HeraldPipelineConfig` (the first skip measuring
    window must end inside the run)."""
    total = getattr(cfg.data, "num_train_batches", None)
    return HeraldPipelineConfig.from_hydra(cfg.pipeline, None if total is None else int(total) * int(cfg.epochs))


def preflight(cfg: DictConfig, world_size: Optional[int] = None) -> DataSource:
    """Every check of a run's config that needs no model, no process group and no training step: every
    group validates itself (``torchrec_herald.config.validate``), then what spans groups and the data:
    the checkpoint folder, the data source and its files, the look-ahead window against the data's
    batches (a file's records are counted up to the window; the rest of a file is checked as it is
    read) and the skipping windows against the run's length. Raises ValueError (a data file:
    DataFormatError / FileNotFoundError) with one line naming the key or file; ``python -m
    torchrec_herald.train`` runs it for the herald run and its baseline before either trains.
    ``world_size``: default ``$WORLD_SIZE`` (torchrun sets it), else 1. Returns the data source."""
    from torchrec_herald.config import validate
    from torchrec_herald.run_identity import check_checkpoint_location, run_name

    world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
    typed = validate(cfg)
    run_name(cfg, world)  # run_name: a folder name
    check_checkpoint_location(cfg, world, writing=typed.checkpoint.every_n_steps is not None)
    data = build_data_source(cfg.data)
    data.check()
    if isinstance(typed.pipeline, HeraldPipelineConfig):
        total = getattr(data, "num_train_batches", None)
        typed.pipeline.check_run_length(None if total is None else int(total) * typed.epochs)
        check_window(data, typed.pipeline.window, world, typed.batch_size)
    return data


def check_window(data: DataSource, window: int, world_size: int, batch_size: int) -> None:
    """``pipeline.window`` fits in one pass over the data: ValueError naming the key otherwise (a source
    that cannot count its batches, none here, is checked as it is read)."""
    total = getattr(data, "num_train_batches", None)
    if total is not None:
        if window > int(total):
            raise ValueError(f"pipeline.window={window} is larger than the {int(total)} batch(es) the data "
                             f"loader has (data.num_train_batches); lower pipeline.window")
        return
    found = data.count_train_batches(world_size, batch_size, at_least=window)
    if found is not None and found < window:
        raise ValueError(f"pipeline.window={window} is larger than the {found} global batch(es) of {world_size} × "
                         f"{batch_size} samples that {data.describe()} holds (data.paths); lower pipeline.window")


def herald_traffic_report(dmp: nn.Module, plan: Any, steps: int, measured: bool = True) -> Dict[str, Any]:
    """Herald tables' traffic per step (all ranks): the planner's prediction vs what the sharded
    module counted, per table and in total (collective; empty dict for stock plans). ``measured=False``
    (HeraldTrainPipeline's plan mode, whose transfers the module's per-table counters do not see):
    prediction only."""
    from torchrec_herald.planner import herald_tables
    from torchrec_herald.sharding import ShardedHeraldEmbeddingBagCollection

    specs = herald_tables(plan)
    if not specs:
        return {}
    local: Dict[str, Dict[str, float]] = {}
    for m in dmp.modules():
        if isinstance(m, ShardedHeraldEmbeddingBagCollection):
            local.update(m.traffic_by_table())
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    predicted = {t: s.expected.get("herald_total", float("nan")) for t, s in specs.items()}
    if not measured:
        return {"hot_rows": {t: int(s.hot_ids.numel()) for t, s in specs.items()},
                "sync": {t: s.sync for t, s in specs.items()}, "predicted_bytes_per_step": predicted,
                "predicted_total": sum(predicted.values()),
                "predicted_stock_table_wise": sum(s.expected.get("stock_table_wise", 0.0) for s in specs.values())}
    measured_t = {t: sum(sum(g[t].values()) for g in gathered) / steps for t in local}
    return {
        "hot_rows": {t: int(s.hot_ids.numel()) for t, s in specs.items()},
        "sync": {t: s.sync for t, s in specs.items()},
        "predicted_bytes_per_step": predicted,
        "measured_bytes_per_step": measured_t,
        "predicted_total": sum(predicted.values()),
        "measured_total": sum(measured_t.values()),
        "predicted_stock_table_wise": sum(s.expected.get("stock_table_wise", 0.0) for s in specs.values()),
        "measured_by_kind": {k: sum(g[t][k] for g in gathered for t in local) / steps
                             for k in ("ids", "pooled", "grads", "hot_sync")},
    }


def approximate_report(cfg: DictConfig, pipeline: Any, eval_metrics: Dict[str, float],
                       reference: Optional[Dict[str, Any]], steps: int) -> Dict[str, Any]:
    """What an approximate run costs in accuracy: its exact-mode reference (same batches, same held-out
    split), the AUC/logloss deltas, the share of updates skipped, reads served stale and the max
    staleness seen (empty dict for exact runs)."""
    if not is_approximate(cfg):
        return {}
    st = pipeline.stats
    out: Dict[str, Any] = {
        "staleness": cfg.pipeline.staleness, "skip": cfg.pipeline.skip,
        "stale_read_share": st.stale_reads / max(st.counters.reads, 1), "stale_reads_per_step": st.stale_reads / steps,
        "max_staleness": st.max_staleness,
        "skipped_update_share": st.skipped_updates / max(st.candidate_updates, 1),
        "skipped_inputs_per_step": st.skipped_inputs / steps,
        "skip_thresholds": [list(h) for h in (pipeline.skipper.history if pipeline.skipper else [])],
    }
    if reference is not None:
        ref_eval = reference["eval"]
        out["reference"] = {"eval": ref_eval, "train_logloss": reference["train_logloss"],
                            "samples_per_s": reference["samples_per_s"],
                            "bytes_per_step": reference["traffic_per_step_total"]["bytes"],
                            "embedding_bytes_per_step": embedding_bytes_per_step(reference)}
        out["auc_delta"] = eval_metrics.get("auc", float("nan")) - ref_eval.get("auc", float("nan"))
        out["logloss_delta"] = eval_metrics.get("logloss", float("nan")) - ref_eval.get("logloss", float("nan"))
    return out


def _percentiles(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {}
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"mean": t.mean().item(), "p50": q[0].item(), "p90": q[1].item(), "p99": q[2].item()}


@torch.no_grad()
def evaluate(dmp: DistributedModelParallel, batches: Iterator[Any], device: torch.device) -> Dict[str, float]:
    """AUC (torchmetrics, synced over ranks) and mean logloss on the held-out split."""
    from torchmetrics.classification import BinaryAUROC

    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros(2, dtype=torch.float64)
    dmp.eval()
    for batch in batches:
        _, (_, logits, labels) = dmp(batch.to(device))
        logits, labels = logits.float().view(-1), labels.float().view(-1)
        auroc.update(torch.sigmoid(logits), labels.long())
        loss_sum += torch.tensor([nn.functional.binary_cross_entropy_with_logits(
            logits, labels, reduction="sum").item(), labels.numel()], dtype=torch.float64)
    dmp.train()
    dist.all_reduce(loss_sum)
    if loss_sum[1] == 0:
        return {"auc": float("nan"), "logloss": float("nan"), "samples": 0}
    return {"auc": auroc.compute().item(), "logloss": (loss_sum[0] / loss_sum[1]).item(),
            "samples": int(loss_sum[1].item())}


def is_approximate(cfg: DictConfig) -> bool:
    """An opt-in approximate mode (bounded staleness or stale-update skipping) is configured."""
    return cfg.pipeline.name == "herald" and (cfg.pipeline.get("staleness") is not None
                                              or cfg.pipeline.get("skip") is not None)


def exact_reference_config(cfg: DictConfig) -> DictConfig:
    """The same run in herald's exact mode (no staleness, no skipping)."""
    ref = copy.deepcopy(cfg)  # keeps the typed (structured) nodes
    ref.pipeline.staleness = None
    ref.pipeline.skip = None
    ref.pipeline.scheduling = "on"  # the approximate run keeps its plan on: so does its reference
    return ref


class Checkpointing:
    """The trainer's checkpoints (``checkpoint.*``): every ``every_n_steps`` steps a DCP save of the model,
    the optimizers and the position (epoch, batch, every rank's losses, RNG, herald's pipeline counters)
    into the run's own folder (:func:`~torchrec_herald.run_identity.checkpoint_dir`: derived from the
    config, so re-running the same command finds it); at start, a resume from its latest complete
    checkpoint (``checkpoint.resume``). A herald pipeline flushes and restarts its window at a save, in an
    uninterrupted run as in a resumed one, so both train the same batches the same way."""

    def __init__(self, cfg: DictConfig, dmp: nn.Module, optimizer: Any, pipeline: Any, world_size: int) -> None:
        from torchrec_herald.run_identity import checkpoint_dir

        c = cfg.get("checkpoint") or {}
        self.every = c.get("every_n_steps")
        self.keep = int(c.get("keep") if c.get("keep") is not None else 2)
        self.resume_enabled = bool(c.get("resume", True))
        self.dir = checkpoint_dir(cfg, world_size)
        self.dmp, self.optimizer, self.pipeline = dmp, optimizer, pipeline

    def due(self, step: int) -> bool:
        return bool(self.every) and step % int(self.every) == 0

    def resume(self) -> Optional[Dict[str, Any]]:
        """Load the run's latest complete checkpoint (collective; rank 0 picks it) and say so in one line;
        with ``checkpoint.resume=false`` move the folder's checkpoints aside (kept, renamed) and start
        fresh. Returns the checkpoint's trainer state (with ``path``), or None."""
        from torchrec_herald.checkpoint import latest_checkpoint, load_checkpoint, set_rng_state

        choice: List[Any] = [None]
        if dist.get_rank() == 0:
            latest = latest_checkpoint(self.dir)
            if latest is not None and not self.resume_enabled:
                aside = self.dir.with_name(f"{self.dir.name}.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
                self.dir.rename(aside)
                logger.warning("checkpoint.resume=false: starting fresh; the earlier checkpoints of this run were "
                               "moved to %s", aside)
                latest = None
            choice[0] = str(latest or "")
        dist.broadcast_object_list(choice, src=0)
        if not choice[0]:
            if self.every:
                logger.info("checkpoints of this run: %s (every %d steps; re-running the same command resumes "
                            "from the latest)", self.dir, int(self.every))
            return None
        state = load_checkpoint(Path(choice[0]), self.dmp, self.optimizer)
        set_rng_state(state["rng"])
        if isinstance(self.pipeline, HeraldTrainPipeline):
            self.pipeline.load_state_dict(state["pipeline"])
        logger.warning("resuming from checkpoint %s: step %d (epoch %d, batch %d of it); checkpoint.resume=false "
                       "starts fresh", choice[0], state["step"], state["epoch"], state["batch_in_epoch"])
        return dict(state, path=choice[0])

    def completed_metrics(self) -> Optional[Dict[str, Any]]:
        """The metrics a run that already finished left in its checkpoint folder, or None."""
        path = self.dir / "metrics.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def record_completion(self, run_dir: Path) -> None:
        """Rank 0: leave the finished run's ``metrics.json`` and ``losses.json`` beside its checkpoints (a
        re-run reports them instead of training nothing)."""
        if self.every and dist.get_rank() == 0 and self.dir.is_dir():
            for name in ("metrics.json", "losses.json"):
                shutil.copyfile(run_dir / name, self.dir / name)

    def save(self, step: int, epoch: int, batch_in_epoch: int, losses: List[float], it: Iterator[Any],
             restart: Any) -> Iterator[Any]:
        """Save (collective); returns the iterator to go on with (a herald pipeline's window restarts at
        the data position, from ``restart()``)."""
        from torchrec_herald.checkpoint import rng_state, save_checkpoint

        herald = isinstance(self.pipeline, HeraldTrainPipeline)
        if herald:
            self.pipeline.reset_window()
            it = restart()
        by_rank: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(by_rank, losses)
        state = {"epoch": epoch, "batch_in_epoch": batch_in_epoch, "losses_by_rank": by_rank, "rng": rng_state(),
                 "pipeline": self.pipeline.state_dict() if herald else None}
        save_checkpoint(self.dir, step, self.dmp, self.optimizer, state, self.keep)
        return it


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


def run_training(cfg: DictConfig, run_dir: Path, show_progress: bool = True) -> Dict[str, Any]:
    """Train on every rank of the (already or newly) initialised process group; rank 0 writes
    ``run_dir/metrics.json`` and a plot. Returns the metrics dict (same on every rank).

    An approximate run (``pipeline.staleness`` / ``pipeline.skip``) with ``pipeline.reference`` first
    trains the exact mode on the same batches (into ``run_dir/exact_reference``) and records it and the
    deltas under ``metrics["approximate"]``."""
    reference = None
    data = preflight(cfg)
    if is_approximate(cfg) and cfg.pipeline.get("reference", True):
        reference = run_training(exact_reference_config(cfg), Path(run_dir) / "exact_reference", show_progress)
    rank, world, device = init_distributed()
    run_dir = Path(run_dir)
    setup_logging(run_dir, rank)
    torch.manual_seed(cfg.seed)
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, device)
    sharding_plan = decision.plan
    plan = describe_plan(sharding_plan)
    logger.info("world_size=%d local_batch=%d plan=%s", world, cfg.batch_size, plan)
    pipeline = build_pipeline(cfg, dmp, optimizer, device, decision)

    losses: List[float] = []
    step_times: List[float] = []
    ckpt = Checkpointing(cfg, dmp, optimizer, pipeline, world)
    start_epoch, start_batch = 0, 0
    resumed = ckpt.resume()
    if resumed is not None:
        losses = list(resumed["losses_by_rank"][rank])
        start_epoch, start_batch = int(resumed["epoch"]), int(resumed["batch_in_epoch"])
    restored = len(losses)  # steps trained by earlier attempts: this attempt's figures leave them out
    restored_stats = copy.deepcopy(pipeline.stats) if isinstance(pipeline, HeraldTrainPipeline) else None
    total_batches = getattr(data, "num_train_batches", None)
    bar = tqdm(total=(total_batches * cfg.epochs if total_batches else None), desc="train", unit="step",
               disable=not (show_progress and rank == 0), dynamic_ncols=True, file=sys.stderr, initial=len(losses))
    meter = TrafficMeter(embedding_dim=cfg.model.embedding_dim)
    train_start = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        batch_in_epoch = start_batch if epoch == start_epoch else 0
        it = train_stream(data, pipeline, rank, world, cfg.batch_size, start=batch_in_epoch)
        while True:
            t0 = time.perf_counter()
            if isinstance(pipeline, HeraldTrainPipeline):  # a checkpoint after this step restarts its window
                pipeline.reset_after_step = ckpt.due(len(losses) + 1)
            try:
                with meter:
                    out = pipeline.progress(it)
            except StopIteration:
                break
            loss = out[0].item()
            step_times.append(time.perf_counter() - t0)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {len(losses)} (epoch {epoch})")
            losses.append(loss)
            batch_in_epoch += 1
            if ckpt.due(len(losses)):
                it = ckpt.save(len(losses), epoch, batch_in_epoch, losses, it,
                               lambda: train_stream(data, pipeline, rank, world, cfg.batch_size, start=batch_in_epoch))
            fault_injection(len(losses), rank)
            bar.update(1)
            if len(losses) % cfg.log_every == 0:
                bar.set_postfix(loss=f"{sum(losses[-cfg.log_every:]) / cfg.log_every:.4f}")
                logger.info("step %d loss %.5f", len(losses), loss)
    train_time = time.perf_counter() - train_start
    bar.close()
    steps, attempt_steps = len(losses), len(losses) - restored
    if attempt_steps == 0 and resumed is not None:
        return _already_complete(ckpt, resumed, rank, run_dir)
    if steps == 0:
        raise RuntimeError(f"no training step ran: {data.describe()} yielded no full global batch of "
                           f"{world} × {cfg.batch_size} samples (data.*, batch_size)")

    if isinstance(pipeline, HeraldTrainPipeline) and pipeline.by_home:  # each rank counted its own rows
        pipeline.stats.counters = pipeline.plan_counters_all_ranks()
    attempt_stats = (pipeline.stats.minus(restored_stats) if restored_stats is not None else None)
    # the meter, the step timer and the clock saw this attempt's steps only
    traffic = reduce_summaries(meter.summary())
    traffic_tags = reduce_summaries(meter.tag_summary())
    per_step = {k: {m: v / attempt_steps for m, v in s.items()} for k, s in traffic.items()}
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= world
    plan_mode = isinstance(pipeline, HeraldTrainPipeline) and pipeline.sync == "lazy"
    herald = herald_traffic_report(dmp, sharding_plan, attempt_steps, measured=not plan_mode)
    if hasattr(pipeline, "detach"):
        pipeline.detach()  # restore the forwards TrainPipelineSparseDist rewrote / flush herald's caches
    eval_metrics = evaluate(dmp, data.eval_batches(rank, world, cfg.batch_size), device) if cfg.eval else {}
    window = max(1, min(50, steps // 5))
    metrics: Dict[str, Any] = {
        "world_size": world,
        "local_batch_size": cfg.batch_size,
        "global_batch_size": world * cfg.batch_size,
        "steps": steps,
        "steps_this_attempt": attempt_steps,
        "resumed_from_step": restored if resumed is not None else None,
        "resumed_from": resumed["path"] if resumed is not None else None,
        "checkpoint_dir": str(ckpt.dir) if ckpt.every else None,
        "train_time_s": train_time,
        "samples_per_s": attempt_steps * world * cfg.batch_size / train_time,
        "step_time_s": _percentiles(step_times),
        "step_time_breakdown_ms": step_time_breakdown(train_time / attempt_steps, meter.wait_s / attempt_steps,
                                                      *(x / attempt_steps for x in scheduler_seconds(attempt_stats))),
        "train_logloss": loss_t[-window:].mean().item(),
        "train_logloss_first": loss_t[:window].mean().item(),
        "eval": eval_metrics,
        "traffic_per_step": per_step,
        "traffic_per_step_total": {m: sum(s[m] for s in per_step.values())
                                   for m in ("calls", "bytes", "embedding_vectors")},
        "traffic_per_step_by_tag": {k: {m: v / steps for m, v in s.items()} for k, s in traffic_tags.items()},
        "plan": plan,
        "link_decision": decision.link_report(),
        "dense_sync": "forward_ordered" if getattr(dmp, "dense_sync", None) is not None else "ddp",
        "herald": herald,
        "herald_pipeline": (attempt_stats.summary(train_time / attempt_steps) | {"sync": pipeline.sync,
                            "allocator": pipeline.allocator, "window": pipeline.window,
                            "scheduling": pipeline.scheduling_report()}
                            if isinstance(pipeline, HeraldTrainPipeline) else {}),
        "data_stats": data.stats(),
        "peak_rss_mib_by_rank": peak_rss_mib_by_rank(),
        "approximate": approximate_report(cfg, pipeline, eval_metrics, reference, attempt_steps),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    metrics["summary"] = headline(metrics)
    if rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (run_dir / "losses.json").write_text(json.dumps(loss_t.tolist()))
        _plot(run_dir, loss_t.tolist(), metrics)
        logger.info("wrote %s", run_dir / "metrics.json")
        ckpt.record_completion(run_dir)
    dist.barrier()
    return metrics


def _already_complete(ckpt: Checkpointing, resumed: Dict[str, Any], rank: int, run_dir: Path) -> Dict[str, Any]:
    """A re-run whose latest checkpoint is the run's end: report the finished run's metrics, left beside
    its checkpoints (copied into this run dir), instead of figures over zero steps; without them, say
    how to train it again."""
    metrics = ckpt.completed_metrics()
    if metrics is None:
        raise ValueError(f"the run is already complete at step {resumed['step']} (checkpoint {resumed['path']}): "
                         f"nothing to train; checkpoint.resume=false trains it again")
    if rank == 0:
        logger.warning("the run already finished at step %d (checkpoint %s); reporting its figures from %s",
                       resumed["step"], resumed["path"], ckpt.dir / "metrics.json")
        for name in ("metrics.json", "losses.json"):
            shutil.copyfile(ckpt.dir / name, run_dir / name)
    dist.barrier()
    return metrics


def peak_rss_mib_by_rank() -> List[float]:
    """Every rank's peak resident memory so far in MiB (``getrusage``; collective)."""
    import resource

    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [round(float(x), 1) for x in out]


def _plot(run_dir: Path, losses: List[float], metrics: Dict[str, Any]) -> None:
    """training.png: the loss curve and this run's traffic per step in the report's four parts
    (embedding vectors, ids and lengths, herald's scheduling, the dense all-reduce)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchrec_herald.report import traffic_groups

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    k = max(1, len(losses) // 50)
    smooth = [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]
    a.plot([i * k for i in range(len(smooth))], smooth)
    a.set(xlabel="step", ylabel="train logloss (mean over ranks)", title="loss")
    parts = traffic_groups(metrics)
    names = list(parts)[::-1]
    b.barh(names, [parts[n] / 1024 for n in names], color=["#d9d9d9", "#dd8452", "#9db4d8", "#4c72b0"])
    for y, n in enumerate(names):
        b.text(parts[n] / 1024, y, f" {parts[n] / 1024:.0f}", va="center", fontsize=8)
    b.set(xlabel="KiB per step (all ranks, sent to other ranks)", title="traffic by kind")
    fig.tight_layout()
    fig.savefig(run_dir / "training.png", dpi=100)
    plt.close(fig)


def step_time_breakdown(step_s: float, wait_s: float, scheduler_critical_s: float = 0.0,
                        scheduler_overlapped_s: float = 0.0) -> Dict[str, float]:
    """Where a rank's step wall time goes (all arguments per step, seconds), ms: ``comm_wait`` (blocked in
    collectives: sync calls and the ``wait()`` of async ones; DDP's all-reduce is awaited in autograd's
    C++ and counts as compute), ``scheduler_critical`` (herald scheduling on the critical path, its
    collectives excluded), ``compute`` (the rest), and ``scheduler_overlapped`` (scheduling the run-ahead
    thread did while steps trained: not part of the step)."""
    return {"step": 1e3 * step_s, "compute": 1e3 * (step_s - wait_s - scheduler_critical_s),
            "comm_wait": 1e3 * wait_s, "scheduler_critical": 1e3 * scheduler_critical_s,
            "scheduler_overlapped": 1e3 * scheduler_overlapped_s}


def scheduler_seconds(stats: Any) -> tuple[float, float]:
    """A herald pipeline's scheduling seconds in ``stats`` (its SchedulerStats): (on the critical path, its
    collectives excluded; done ahead by the run-ahead thread). Zero for None (TorchRec's pipelines)."""
    if stats is None:
        return 0.0, 0.0
    return stats.scheduler_s - stats.comm_s, stats.ahead_s


def _breakdown_cell(m: Dict[str, Any]) -> str:
    b = m.get("step_time_breakdown_ms")
    if not b:
        return "–"
    return (f"{b['step']:.1f} = {b['compute']:.1f} + {b['comm_wait']:.1f} + {b['scheduler_critical']:.1f} "
            f"(ahead {b['scheduler_overlapped']:.1f})")


def format_comparison_table(runs: Dict[str, Dict[str, Any]]) -> str:
    """Markdown table, one column per run (e.g. stock baseline vs herald) and a last/first ratio."""
    names = list(runs)
    ms = [runs[n] for n in names]

    def emb_kib(m: Dict[str, Any]) -> float:
        return embedding_bytes_per_step(m) / 1024

    rows = [
        ("plan", [", ".join(f"{v}×{k}" for k, v in sorted(Counter(m["plan"].values()).items())) for m in ms], None),
        ("steps", [m["steps"] for m in ms], None),
        ("KiB sent per step (all ranks)", [m["traffic_per_step_total"]["bytes"] / 1024 for m in ms], "ratio"),
        ("embedding KiB per step", [emb_kib(m) for m in ms], "ratio"),
        ("embedding vectors per step", [m["traffic_per_step_total"]["embedding_vectors"] for m in ms], "ratio"),
        ("samples/s", [m["samples_per_s"] for m in ms], "ratio"),
        ("step ms = compute + comm wait + scheduler (ahead: off the path)", [_breakdown_cell(m) for m in ms], None),
        ("train logloss (last)", [m["train_logloss"] for m in ms], "diff"),
        ("eval AUC", [m["eval"].get("auc", float("nan")) for m in ms], "diff"),
        ("eval logloss", [m["eval"].get("logloss", float("nan")) for m in ms], "diff"),
    ]
    head = "| metric | " + " | ".join(names) + f" | {names[-1]} vs {names[0]} |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for label, vals, kind in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) and abs(v) < 10 else
                 (f"{v:.1f}" if isinstance(v, float) else str(v)) for v in vals]
        if kind == "ratio" and vals[0]:
            cmp = f"{vals[-1] / vals[0]:.3f}× ({100 * (vals[-1] / vals[0] - 1):+.1f} %)"
        elif kind == "diff":
            cmp = f"{vals[-1] - vals[0]:+.4f}"
        else:
            cmp = ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cmp} |")
    return "\n".join(lines)


def format_metrics_table(metrics: Dict[str, Any]) -> str:
    """Markdown table of the headline figures of one run."""
    ev = metrics.get("eval", {})
    tot = metrics["traffic_per_step_total"]
    rows = [
        ("ranks × local batch", f"{metrics['world_size']} × {metrics['local_batch_size']}"),
        ("steps", metrics["steps"]),
        ("samples/s", f"{metrics['samples_per_s']:.0f}"),
        ("step time p50 / p90 (ms)", f"{metrics['step_time_s']['p50'] * 1e3:.1f} / "
                                     f"{metrics['step_time_s']['p90'] * 1e3:.1f}"),
        ("step ms = compute + comm wait + scheduler (ahead: off the path)", _breakdown_cell(metrics)),
        ("train logloss first → last", f"{metrics['train_logloss_first']:.4f} → {metrics['train_logloss']:.4f}"),
        ("eval AUC", f"{ev.get('auc', float('nan')):.4f}"),
        ("eval logloss", f"{ev.get('logloss', float('nan')):.4f}"),
        ("KiB sent per step (all ranks)", f"{tot['bytes'] / 1024:.1f}"),
        ("embedding vectors per step", f"{tot['embedding_vectors']:.0f}"),
    ]
    for kind, s in metrics["traffic_per_step"].items():
        rows.append((f"  {kind} KiB/step", f"{s['bytes'] / 1024:.1f}"))
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
