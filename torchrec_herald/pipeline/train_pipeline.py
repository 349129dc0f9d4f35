"""HeraldTrainPipeline: Herald's embedding scheduling as a TorchRec train pipeline (docs/design.md §3, Herald).

A look-ahead window of the next K global batches feeds (1) the location-aware input allocator, which
moves samples to the rank that holds their rows, and (2) the lazy, exact communication plan over worker
caches and hot replicas (a :class:`~torchrec_herald.plans.CommPlanner`), which the herald EBC executes
(:class:`~torchrec_herald.sharding.plan_exec.PlanExecutor`). Drop-in for ``TrainPipelineSparseDist``:
same constructor arguments, ``progress(dataloader_iter)``. Opt-in approximate modes: HET's bounded
staleness (``staleness=s``) and Slipstream's stale-update skipping (``skip="input"|"row"``, a hook).

This module holds the window loop. Each batch entering the window runs the stages of
``pipeline/stages/`` (keys → allocate → reads) as the scheduling strategy (``pipeline/strategies/``:
whole global batches, gathered per-rank batches, or planning by home) says; each step then plans
(``stages/plan.py``) and trains (:meth:`HeraldTrainPipeline.train_step`). A batch's state between stages
is its :class:`~torchrec_herald.pipeline.context.HeraldBatchContext` (a TorchRec ``TrainPipelineContext``).
The run-ahead worker (``pipeline/run_ahead.py``) schedules the next batch while a step trains, and
``scheduling=off|auto`` is a :class:`~torchrec_herald.pipeline.auto_scheduling.SchedulingSwitch`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.comm import row_with_state_bytes
from torchrec_herald.data import TrainStream
from torchrec_herald.dist_utils import device_sync
from torchrec_herald.layout import cache_rows_for_budget
from torchrec_herald.pipeline.auto_scheduling import SchedulingSwitch
from torchrec_herald.pipeline.context import (EVERY_RANK, HeraldBatchContext, SchedulerStats, SchedulingEnv,
                                              find_herald_ebc, herald_ebcs, select_samples, stock_tables_beside)
from torchrec_herald.pipeline.input_allocator import InputAllocator, build_allocator
from torchrec_herald.pipeline.options import (ALLOCATORS, AUTO_MAX_PRICED_PENALTY, CACHE_POLICIES,
                                              GLOBAL_PLANNING_MAX_WORLD, PER_RANK_ALLOCATOR_REASON, SYNC_MODES,
                                              HeraldPipelineConfig)
from torchrec_herald.pipeline.run_ahead import RunAhead
from torchrec_herald.pipeline.stages import batch_stages
from torchrec_herald.pipeline.stages.keys import CheckedOwnBatches
from torchrec_herald.pipeline.stages.plan import make_plan, plan_head
from torchrec_herald.pipeline.stale_skip import LiveInputStream, RankInputStream, StaleSkipHook, StaleSkipper
from torchrec_herald.pipeline.strategies import SchedulingStrategy, build_planner, build_strategy, strategy_name
from torchrec_herald.plans import CommPlanner, SyncCounters

logger = logging.getLogger(__name__)

__all__ = ["ALLOCATORS", "CACHE_POLICIES", "SYNC_MODES", "HeraldBatchContext", "HeraldTrainPipeline", "SchedulerStats",
           "batch_statistics_layers", "select_samples"]


def batch_statistics_layers(model: nn.Module) -> List[str]:
    """The layers of ``model`` whose training output depends on which samples share a rank's batch: batch norms
    that normalise by their own rank's batch (``SyncBatchNorm``, over every rank's, does not). Moving samples
    between ranks (the greedy input allocator) would change what they compute; stock TorchRec keeps each rank's
    batch as its loader gave it."""
    while True:  # (the user's names, inside DMP's and DDP's wrappers)
        inner = getattr(model, "_dmp_wrapped_module", None)
        if isinstance(inner, nn.Module) or isinstance(model, nn.parallel.DistributedDataParallel):
            model = inner if isinstance(inner, nn.Module) else model.module
            continue
        break

    def batch_norm(m: nn.Module) -> Optional[str]:  # (a TorchScript-ed one says its class by name alone)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return None if isinstance(m, nn.SyncBatchNorm) else type(m).__name__
        name = getattr(m, "original_name", "") if isinstance(m, torch.jit.RecursiveScriptModule) else ""
        return name if name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d") else None

    return [f"{name or '(the model)'} ({kind})" for name, m in model.named_modules() if (kind := batch_norm(m))]


class HeraldTrainPipeline(TrainPipeline[Batch, Any]):
    """Herald's train pipeline: look-ahead window, location-aware input allocator, worker caches with an
    exact, lazy communication plan. Drop-in for ``torchrec``'s ``TrainPipelineSparseDist``.

    Each :meth:`progress` trains one global batch: plan its transfers from the window (every rank the
    same plan), pull the rows it reads that are missing or outdated, forward/backward with every lookup
    local, sum each row's gradients at one reducer and apply the exact update there, push rows another
    rank reads next, step the dense optimizer. When the loader runs dry the last partial window is
    trained, then every copy is flushed back to herald's stock layout and ``StopIteration`` is raised.

    Args:
        model: a ``DistributedModelParallel`` whose EBC is herald-sharded; ``model(batch)`` returns
            ``(loss, output)`` (TorchRec's ``DLRMTrain``).
        optimizer: the dense (+ fused) optimizer, stepped after every backward.
        device: the training device.
        execute_all_batches, apply_jit: accepted for signature compatibility (every batch is trained;
            no JIT).
        config: a validated :class:`~torchrec_herald.pipeline.options.HeraldPipelineConfig`; or its
            fields as keyword options (``window``, ``allocator``, ``sync``, ``cache``, ``cache_fraction``,
            ``move_penalty``, ``staleness``, ``skip``, ...). The command line's ``pipeline=herald`` is the
            same dataclass with the same defaults.
    """

    @classmethod
    def for_model(cls, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                  execute_all_batches: bool = True, apply_jit: bool = False, **options: Any) -> TrainPipeline:
        """The pipeline for whatever ``model``'s plan is (``HeraldPlanner.decide`` may pick a stock plan): this
        pipeline where one EBC is herald-sharded, else TorchRec's ``TrainPipelineSparseDist`` (herald's options
        then have nothing to act on), said in one line."""
        found = len(herald_ebcs(model))
        if found == 1:
            return cls(model, optimizer, device, execute_all_batches, apply_jit, **options)
        logger.log(logging.WARNING if options else logging.INFO,
                   "HeraldTrainPipeline.for_model: %s; training with TorchRec's TrainPipelineSparseDist%s",
                   "no herald-sharded EBC (a stock plan)" if found == 0 else
                   f"{found} herald-sharded EBCs (herald's scheduling drives one; their hot replication trains "
                   f"under TorchRec's pipeline)", f" (herald's options {sorted(options)} not applied)" if options else "")
        return TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=execute_all_batches,
                                       apply_jit=apply_jit)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 execute_all_batches: bool = True, apply_jit: bool = False, *,
                 config: Optional[HeraldPipelineConfig] = None, **options: Any) -> None:
        self.config = config if config is not None else HeraldPipelineConfig(**options)
        if config is not None and options:
            raise ValueError(f"pass either config or keyword options, not both (got {sorted(options)})")
        super().__init__()
        self._model, self._optimizer, self._device = model, optimizer, device
        self._warned_eval_in_flight = False
        self.ebc = find_herald_ebc(model)
        # planning (global or by home) and the allocator follow from the world size (and, at the first
        # loader, from whether it gives whole global batches: _resolve, from the settings as given)
        self._config_set = self.config
        self.config, self.planning_reason = self.config.resolve_planning(self.ebc.world_size)
        batch_norms = batch_statistics_layers(model) if self.config.allocator == "greedy" else []
        if batch_norms and self._config_set.allocator == "greedy":
            raise ValueError(f"pipeline.allocator=greedy moves samples between ranks, and the model's "
                             f"{', '.join(batch_norms)} normalise by each rank's own batch: it would train another "
                             f"model than stock TorchRec. Use pipeline.allocator=identity (or auto), or SyncBatchNorm (on GPUs)")
        if batch_norms:  # (auto: the samples stay where loaded, as stock's)
            self._config_set = dataclasses.replace(self._config_set, allocator="identity")
            self.config, self.planning_reason = self._config_set.resolve_planning(self.ebc.world_size)
            logger.info("pipeline.allocator=auto -> identity: the model's %s normalise by each rank's own batch, "
                        "which moving samples between ranks would change", ", ".join(batch_norms))
        # auto planning globally past the ranks where it would plan by home, for a setting that needs it: a
        # cost a step that grows with W (the reason says which setting)
        scale_cost = (self._config_set.planning == "auto" and self.config.planning == "global"
                      and self.ebc.world_size > GLOBAL_PLANNING_MAX_WORLD)
        logger.log(logging.WARNING if scale_cost else logging.INFO, "%s", self.planning_reason)
        c = self.config
        self.window, self.allocator, self.sync, self.move_penalty = c.window, c.allocator, c.sync, c.move_penalty
        self.staleness = c.staleness
        self.layout = self.ebc.layout
        row_bytes = row_with_state_bytes(self.ebc.embedding_dim)
        capacity_rows = None if c.cache_bytes is None else cache_rows_for_budget(self.layout, c.cache_bytes, row_bytes)
        self.by_home = c.planning == "by_home"
        self._allocator_on = build_allocator(c.allocator, **({"move_penalty": c.move_penalty}
                                                            if c.allocator == "greedy" else {}))
        self._allocator_off = build_allocator("identity")
        self.env = SchedulingEnv(ebc=self.ebc, pg=self.ebc.process_group, world=self.ebc.world_size,
                                 rank=self.ebc.rank, stats=SchedulerStats(), planner=None,  # type: ignore[arg-type]
                                 allocator=self._allocator_on)
        self.env.planner = build_planner(c, self.env, capacity_rows)
        stock_tables = stock_tables_beside(model)
        if stock_tables and c.approximate:
            raise ValueError(f"pipeline.skip and pipeline.staleness need every table of the EBC herald-sharded; the plan "
                             f"keeps tables {stock_tables} stock-sharded beside herald's (per-table decisions): train "
                             f"them exactly (pipeline.skip=null pipeline.staleness=null) or plan every table with herald")
        if c.skip is not None and self.layout.num_hot == 0:
            raise ValueError("pipeline.skip needs hot replication: this plan has no hot rows (planner=herald with a "
                             "planner.hot_memory_budget_bytes that holds some rows)")
        self.skip_hook = (StaleSkipHook(c.skip_config, self.layout.num_hot, device_sync(device)) if c.skip is not None
                          else None)
        #: input skipping on whole global batches (decided with them, in :meth:`_resolve`)
        self.live_inputs: Optional[LiveInputStream] = None
        #: input skipping with scheduling off: this rank's slices, refilled at the shared rate
        self.rank_inputs: Optional[RankInputStream] = None
        self._queue: Deque[HeraldBatchContext] = deque()
        self._fed_off: Deque[Batch] = deque(maxlen=c.window)  # scheduling off: the last batches fed (skip's sample)
        self._exhausted = False
        self._started = False
        self._flushed = True
        self._batch_index = 0
        self._checked: Optional[CheckedOwnBatches] = None  # a loader of per-rank batches, checked (:meth:`_own`)
        self._refill = False  # the window restarts mid-data (a checkpoint): running dry is not an error
        #: decided by :meth:`_resolve` from the first data loader (``config.resolve``)
        self.global_batches: Optional[bool] = None
        self.run_ahead: Optional[bool] = None
        self.strategy: Optional[SchedulingStrategy] = None
        self._ahead: Optional[RunAhead] = None
        self.switch: Optional[SchedulingSwitch] = None
        self._restored_probe: Optional[Dict[str, Any]] = None
        #: :meth:`checkpoint_after_next_step`: the next step's run-ahead job plans nothing ahead (else the
        #: flush at the checkpoint first runs that plan without gradients, which changes no value but
        #: counts its transfers)
        self._checkpoint_next = False
        #: :meth:`checkpoint_schedule`: ``_checkpoint_due(n)``, a checkpoint is saved once ``n`` steps have trained
        self._checkpoint_due: Optional[Callable[[int], bool]] = None
        self._ahead_it: Optional[Iterator[Batch]] = None  # the loader the run-ahead jobs read
        self._took_next = False  # this step took the next step's batch and plan from the run-ahead thread
        #: the run-ahead job's error that every rank raises alike (a bad id in the next batch, context.EVERY_RANK)
        #: taken mid-step: raised by the next progress(), so that the step that took it ends whole
        self._ahead_error: Optional[BaseException] = None
        self.mode = "off" if c.scheduling == "off" else "on"
        self._reads_needed = c.sync == "lazy" and c.scheduling != "off"
        self._apply_mode()

    # ------------------------------------------------------------------ what the rest of the package reads
    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's counters since the start (or since the checkpoint the run resumed from)."""
        return self.env.stats

    @property
    def planner(self) -> CommPlanner:
        """The sync planner in use (the exact lazy plan, HET's bounded staleness, or the eager path)."""
        return self.env.planner

    @property
    def input_allocator(self) -> InputAllocator:
        """The input allocator in use (identity while scheduling is off)."""
        return self.env.allocator

    @property
    def skipper(self) -> Optional[StaleSkipper]:
        """The stale-update skipper's per-run state (None when skipping is off)."""
        return self.skip_hook.skipper if self.skip_hook is not None else None

    def window_batches(self) -> List[Batch]:
        """This rank's batches in the window (after allocation), oldest first; with scheduling off (no
        window), the last batches fed to TorchRec's pipeline."""
        if not self._queue and self.mode == "off":
            return list(self._fed_off)
        return [ctx.batch for ctx in self._queue]

    def batch_keys(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Global row key of every id of ``kjt``."""
        return self.env.batch_keys(kjt)

    def gather_varlen(self, mine: torch.Tensor, label: str) -> List[torch.Tensor]:
        """Every rank's ``mine``, timed as scheduler comm."""
        return self.env.gather_varlen(mine, label)

    # ------------------------------------------------------------------ what the batch stages read (StageHost)
    @property
    def reads_needed(self) -> bool:
        """Every rank's reads are needed for the batches entering the window (the plan is on, or the
        scheduling probe may turn it on)."""
        return self._reads_needed

    @property
    def lazy(self) -> bool:
        """The plan is on now."""
        return self.sync == "lazy"

    # ------------------------------------------------------------------ the loader decides three defaults
    def _resolve(self, it: Iterator[Batch]) -> None:
        """Decide ``global_batches``, ``run_ahead`` and ``scheduling`` for the first data loader (a
        TrainStream can read whole global batches; another loader gives this rank's batches, unless
        ``global_batches=True`` says they are whole), once; build the strategy, the run-ahead worker and
        the scheduling switch they call for."""
        if self.strategy is not None:
            return
        config, why = self._config_set.resolve(whole_batches=isinstance(it, TrainStream), world_size=self.env.world)
        for line in why:
            if line != self.planning_reason:  # (logged when the pipeline was built)
                logger.info("%s", line)
        if self._config_set.allocator == "auto" and config.allocator == "greedy" and not config.global_batches:
            # a move sends the sample: it must pay for itself with one lookup made local
            logger.info("%s", PER_RANK_ALLOCATOR_REASON)
            self._allocator_on.max_priced = AUTO_MAX_PRICED_PENALTY
        self.config = config
        self.global_batches, self.run_ahead = bool(config.global_batches), bool(config.run_ahead)
        self.strategy = build_strategy(strategy_name(config), self.env, config)
        if self.run_ahead and not self.strategy.can_run_ahead:
            raise ValueError(f"pipeline.run_ahead: the {self.strategy.name} scheduling strategy has collectives "
                             f"that must stay in step with training's; it cannot run ahead")
        if (self.strategy.scheduling_collectives or not isinstance(it, TrainStream)) and self.env.world > 1:
            # the scheduler's collectives, and the check of a user's loader's batches with every rank's: on a gloo
            # group of their own (collective: every rank resolves at its first step). Run ahead, they are the worker
            # thread's and never interleave with training's; and their tensors are the host's, which a group the
            # user made NCCL-only would refuse. The ranks of the EBC's group (made by those ranks alone: it may be a
            # subgroup of the job)
            ranks = None if self.env.pg is None else dist.get_process_group_ranks(self.env.pg)
            self.env.sched_pg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
        self._ahead = RunAhead() if self.run_ahead else None
        if self.skip_hook is not None and self.skip_hook.granularity == "input" and self.global_batches:
            self.live_inputs = LiveInputStream(self.skip_hook, self, self.env.world, self._feature_order)
        elif self.skip_hook is not None and self.skip_hook.granularity == "input" and config.scheduling == "on":
            logger.warning("pipeline.skip=input on a loader of each rank's own batches with scheduling on: the stale "
                           "inputs are dropped from each batch without a refill (the batches shrink, an epoch takes "
                           "as many steps); whole global batches (global_batches=true) or scheduling off refill them")
        if config.scheduling in ("off", "auto"):
            if self.skip_hook is not None and self.skip_hook.granularity == "input":
                self.rank_inputs = RankInputStream(self.skip_hook, self, self.env.world, self._feature_order)
            self.switch = SchedulingSwitch(self, config.scheduling, config.probe_steps,
                                           lambda: TrainPipelineSparseDist(self._model, self._optimizer, self._device),
                                           self.env.pg, self.env.world, self.env.rank, device_sync(self._device))
            if self._restored_probe is not None:
                self.switch.restore(self._restored_probe)

    # ------------------------------------------------------------------ window
    def fill(self, it: Iterator[Batch]) -> None:
        """Read batches until the window holds ``window`` of them, running each through the stages."""
        self._resolve(it)
        if len(self._queue) < self.window:  # (a job chained ahead brings the batch after a full window)
            self._collect_ahead()
        while not self._exhausted and len(self._queue) < self.window:
            t0 = time.perf_counter()
            ctx = self.schedule_next(it, self.stats.steps + len(self._queue))
            self.stats.scheduler_s += time.perf_counter() - t0
            if ctx is None:  # (a loader shorter than the window trains every batch, as at any epoch's end)
                break
            self._queue.append(ctx)
        self._started = True
        self._refill = False

    def schedule_next(self, it: Iterator[Batch], train_step: int) -> Optional[HeraldBatchContext]:
        """Read the next batch, which trains at step ``train_step``, and run it through the stages (keys,
        allocate, skip_inputs, reads); None (and the window marked exhausted) when the loader is dry."""
        assert self.strategy is not None
        try:
            if self.live_inputs is not None:
                raw = self.live_inputs.next(self._loader(it), train_step)
            else:
                raw = next(self._loader(it))
        except StopIteration:  # (a loader of per-rank batches: every rank's is dry alike; one dry before the
            self._exhausted = True  # others raised on every rank)
            return None
        ctx = HeraldBatchContext(index=self._batch_index, batch=raw, train_step=train_step)
        self._batch_index += 1
        for _, stage in batch_stages():
            stage(self, ctx)
        if ctx.batch is not None and torch.device(self._device).type == "cuda":
            # the samples this rank trains, staged in pinned memory here (run ahead: the worker's time), so the
            # step's copy to the GPU is queued, not waited for (one from pageable memory may synchronise the
            # stream); TorchRec's pipeline copies its batches ahead on a stream of their own instead
            ctx.batch = ctx.batch.pin_memory()
        return ctx

    def _schedule_ahead(self, it: Iterator[Batch], train_step: int, plan_ahead: bool,
                        window: List[HeraldBatchContext]) -> Optional[HeraldBatchContext]:
        """The run-ahead job: batch t+K (``train_step``) enters the window (allocated under the planner's
        state after plan t, as in the serial order), then plan t+1 is made from ``window`` (the batches
        t+1 … t+K-1 not planned yet, a copy taken when the job was submitted) and the new batch. The step
        takes its batch in :meth:`_collect_ahead`."""
        t0 = time.perf_counter()
        try:
            ctx = self.schedule_next(it, train_step)
            window = window + ([ctx] if ctx is not None else [])
            if plan_ahead and window and self.sync == "lazy":
                window[0].plan = make_plan(self.env, window, self.skip_hook, self)
            return ctx
        finally:
            self.stats.ahead_s += time.perf_counter() - t0

    def _collect_ahead(self) -> None:
        """Take the run-ahead thread's batch into the window (waiting for it if it is not done; its
        errors, e.g. a bad id, are raised here, on every rank alike). An error a step took before
        (:meth:`_next_plan_made_ahead`) is left for the next progress() to raise."""
        if self._ahead is None or not self._ahead.busy:
            return
        ctx, waited = self._ahead.collect()
        self._waited_ahead(waited)
        if ctx is not None:
            self._queue.append(ctx)

    def _raise_ahead_error(self) -> None:
        """Raise the run-ahead job's error that a step took while it trained (:meth:`_next_plan_made_ahead`)."""
        if self._ahead_error is not None:
            error, self._ahead_error = self._ahead_error, None
            raise error

    def _submit_ahead(self, it: Iterator[Batch], chained: bool) -> None:
        """Start the run-ahead job: the next batch enters the window, and the window's first batch with no
        plan yet gets its plan (the batches planned before it are the steps it follows). ``chained``:
        submitted by :meth:`_chain_ahead`, while the step before that batch's trains."""
        assert self._ahead is not None
        queue = list(self._queue)
        first = 0
        while first < len(queue) and queue[first].plan is not None:
            first += 1
        window = queue[first:]
        new_step = queue[-1].train_step + 1 if queue else self.stats.steps + 1
        planned = window[0].train_step if window else new_step  # the step whose plan the job makes
        # that plan is not made ahead where its step flushes first: a checkpoint after the step before it
        # (the trainer's schedule, or checkpoint_after_next_step for this step), a skip snapshot
        checkpoint = ((self._checkpoint_due is not None and self._checkpoint_due(planned))
                      or (not chained and self._checkpoint_next and planned == self.stats.steps + 1))
        plan_ahead = not checkpoint and (self.skip_hook is None or not self.skip_hook.flushes_at(planned))
        self._ahead_it = it
        self._ahead.submit(self._schedule_ahead, it, new_step, plan_ahead, window)

    def _chain_ahead(self) -> None:
        """Where the step that trains now took the next step's plan from the run-ahead thread, start the
        following job (global planning: as the step ends, its collectives under way; planning by home: at
        once), so the thread works through the next step's waits and compute too (a plan made one step
        further ahead; the released Herald's scheduler thread runs ahead through an unbounded queue).
        Not across a checkpoint after this step (its window restarts), not with stale-update skipping (its
        classification changes in :meth:`progress`, before a batch enters the window), and only where the
        next step's plan is made (the job must never plan the batch the next step plans itself)."""
        if (self._ahead is None or self._ahead.busy or self._exhausted or self._ahead_it is None
                or self._ahead_error is not None
                or self._checkpoint_next or self.skip_hook is not None or self.mode != "on"
                or not self._queue or self._queue[0].plan is None):
            return
        self._submit_ahead(self._ahead_it, chained=True)

    def _cancel_ahead(self) -> None:
        """Wait for the run-ahead thread and drop its batch (the window restarts from a new iterator). A
        batch whose plan it made ahead stays in the window, for the flush that follows to run that plan
        without gradients, after the plans before it (the planner's state already counts it)."""
        # (an error a step took is kept for the next progress(): a loader of the user's own may go on past
        # the bad batch, which must not be skipped unsaid)
        if self._ahead is not None:
            ctx = self._ahead.cancel()
            if isinstance(ctx, HeraldBatchContext) and ctx.plan is not None:
                self._queue.append(ctx)

    # ------------------------------------------------------------------ a step
    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """Train one global batch; returns the model's output (as ``TrainPipelineSparseDist`` does). With the
        model in eval mode (``model.eval()``), :meth:`eval_step` instead: a forward of the loader's next batch.

        Raises:
            StopIteration: the loader and the window are empty (copies flushed first).
            ValueError: bad ids (every rank).
        """
        if not self._model.training:
            return self.eval_step(dataloader_iter)
        self._resolve(dataloader_iter)
        self._raise_ahead_error()  # (the last step found a bad batch ahead: nothing of this step has run)
        if self.switch is not None:
            self.switch.before_step()
            if self.mode == "off":
                if self.skip_hook is not None:
                    self.skip_hook.before_step(self, self.stats.steps)
                return self.switch.progress_off(dataloader_iter)
        if isinstance(dataloader_iter, TrainStream):  # scheduling on (again): every rank reads whole batches
            dataloader_iter.whole = self.global_batches
        self.fill(dataloader_iter)
        if not self._queue:
            self.flush()
            self._exhausted = self._started = False  # the next progress() may start a new epoch's iterator
            raise StopIteration
        if self.skip_hook is not None:
            self.skip_hook.before_step(self, self.stats.steps)
        self.plan_step()
        head = self._queue.popleft()
        self._took_next = False
        if self._ahead is not None and not self._ahead.busy and not self._exhausted:
            # the next batch enters the window (allocated under the state after this plan) while this step
            # trains (where the last step chained it, :meth:`_chain_ahead`, that job is running already)
            self._submit_ahead(dataloader_iter, chained=False)
        out = self.train_step(head)
        self._checkpoint_next = False
        return out

    def eval_step(self, dataloader_iter: Iterator[Any]) -> Any:
        """The model's output on the loader's next batch (this rank's), forward only, no gradient and no update,
        as TorchRec's pipelines do with the model in eval mode (collective: the forward's input dist). Herald's
        caches are flushed first (collective), so the forward reads every row's current value; the window's
        training batches stay where they are and train when ``model.train()`` is back.

        Raises:
            StopIteration: the loader is empty.
        """
        self._collect_ahead()
        if self.skip_hook is not None:
            self.skip_hook.stop_clock()  # (the eval's time is no step of the skip search's)
        if self.switch is not None and self.switch.batches_in_flight():
            # scheduling off mid-epoch: TorchRec's pipeline has started the input dists of its next training
            # batches in herald's module; it evaluates them first, as TrainPipelineSparseDist does
            if not self._warned_eval_in_flight:
                logger.warning("model.eval() with %d training batch(es) in flight in TorchRec's pipeline "
                               "(scheduling off): they are evaluated, not trained, as TrainPipelineSparseDist "
                               "does; evaluate after progress() raised StopIteration to train every batch",
                               self.switch.batches_in_flight())
                self._warned_eval_in_flight = True
            return self.switch.eval_in_flight(dataloader_iter)
        if self.switch is not None:
            self.switch.pause_delegate()  # (TorchRec's pipeline rewrote the forwards)
            self.switch.stop_clock()  # (the eval's time is no probe step's)
        self.flush()
        batch = next(dataloader_iter)
        with torch.no_grad():
            _, output = self._model(batch.to(self._device, non_blocking=True))
        return output  # (as the training step and TorchRec's pipelines: the model's second output)

    def checkpoint_after_next_step(self) -> None:
        """The trainer saves a checkpoint after the next :meth:`progress` (and calls :meth:`reset_window`):
        that step plans nothing ahead. The step before it may have planned the step after the checkpoint
        already (the run-ahead jobs chain) unless :meth:`checkpoint_schedule` said so first: the flush at
        the checkpoint then runs that plan without gradients, which changes no value but counts its
        transfers."""
        self._checkpoint_next = True

    def checkpoint_schedule(self, due: Callable[[int], bool]) -> None:
        """The checkpoints to come (``due(n)``: one is saved once ``n`` steps have trained), so that no
        run-ahead job plans a step after a checkpoint ahead of it; the trainer sets it before the first step."""
        self._checkpoint_due = due

    def plan_step(self) -> None:
        """Stage 4 (``stages/plan.py``): plan the head batch's transfers from the window (every rank the
        same plan) and run the pre-read ones; eager sync: count the rows stale-skipping leaves frozen."""
        if plan_head(self.env, list(self._queue), self.sync == "lazy", self.skip_hook, self):
            self._flushed = False

    def _next_plan_made_ahead(self) -> Optional[Any]:
        """The next step's plan, where the run-ahead thread made it (its batch taken into the window)."""
        if self._ahead is None:
            return None
        if not self._took_next:  # (once a step: a second call would take the job chained below)
            self._took_next = True
            try:
                self._collect_ahead()
            except Exception as error:
                if not getattr(error, EVERY_RANK, False):
                    raise  # (one rank's own failure, e.g. its loader's: at once, as a serial step would)
                # a bad id every rank found in the next batch: raised by the next progress(), once this step
                # (every rank's alike, none taking a next plan) has ended
                self._ahead_error = error
                return None
            if self.by_home:
                # planning by home: the job exchanges its messages on a group of its own and needs the whole
                # step (measured: started at the step's end, the next step waits for it); the global plan's
                # job sends nothing and starts as the step ends (train_step)
                self._chain_ahead()
        return self._queue[0].plan if self._queue else None

    def _prefetch_next(self) -> None:
        """Run-ahead: once this step's pushes are done, take the next batch's plan (made ahead) and start
        its pulls, so they travel while the dense optimizer steps and the next step starts."""
        plan = self._next_plan_made_ahead()
        if plan is not None:
            self.ebc.prefetch_plan(plan)

    def train_step(self, ctx: HeraldBatchContext) -> Any:
        """Stage 5: forward/backward of this rank's share, the plan's reduce/update/pushes, the dense step."""
        assert ctx.batch is not None
        self.stats.steps += 1
        self.stats.moved_samples += ctx.moved
        self._optimizer.zero_grad()
        loss, output = self._model(ctx.batch.to(self._device, non_blocking=True))
        torch.sum(loss).backward()
        if self.sync == "lazy":
            # the next plan is taken first where it can join this step's sends (PlanExecutor.finish): the
            # global plan's pushes (exact or bounded staleness, with the next plan's pushes before its reads)
            # and the next step's pulls travel in one all-to-all. Planning by home's exact plan
            # (its plans partial: nothing joins) takes it after its pushes, in _prefetch_next, so that its
            # job, which exchanges messages, starts after them
            joins = bool(self.staleness) or not self.by_home
            self.ebc.finish_plan_step(self._next_plan_made_ahead() if joins else None)
            self._prefetch_next()
        self._optimizer.step()
        if self._took_next:
            # the next job starts once this step's collectives are under way: its thread's Python would
            # otherwise hold the GIL while the update and the sends the next step waits for are made
            # (planning by home chained it already)
            self._chain_ahead()
        return output

    # ------------------------------------------------------------------ modes (SchedulingSwitch's host)
    def _apply_mode(self) -> None:
        """``on``: the configured allocator and sync; ``off``: hot replication alone (samples stay where
        loaded, herald's per-step path)."""
        on = self.mode == "on"
        self.sync = self.config.sync if on else "eager"
        self.env.allocator = self._allocator_on if on else self._allocator_off
        dense_sync = getattr(self._model, "dense_sync", None)
        if dense_sync is not None:
            # the dense sums start inside backward where herald sends no gradient after it: HET's plan
            # (s >= 1) updates each copy where it is read; hot replication's hot-row sum and the exact
            # plan's gradient reduce would queue behind them, and the next step needs those first
            dense_sync.start_in_backward = on and self.sync == "lazy" and (self.staleness or 0) > 0

    def enter_mode(self, mode: str) -> None:
        """Train in ``mode`` from the next step (every rank at the same step): leaving the plan flushes it."""
        self._collect_ahead()
        if self.mode == "on" and self.sync == "lazy":
            self.flush()
        if mode == "on" and self.rank_inputs is not None:
            self.rank_inputs.start(None)  # its carried live samples do not cross into whole global batches
        self.mode = mode
        self._apply_mode()

    def settle(self) -> None:
        """Take the run-ahead thread's batch into the window and flush the plan."""
        self._collect_ahead()
        self.flush()

    def take_window_batches(self) -> List[Batch]:
        """This rank's batches in the window, oldest first; the window emptied."""
        queued = [ctx.batch for ctx in self._queue]
        self._queue.clear()
        return queued

    def stop_collecting_reads(self) -> None:
        """Stop recording each batch's reads (stale-update skipping needs them only while it measures)."""
        self._reads_needed = False

    def off_stream(self, it: Iterator[Batch], first_step: int) -> Iterator[Batch]:
        """Scheduling off: this rank's batches from ``it`` for TorchRec's pipeline, the first training at
        ``first_step``. A :class:`~torchrec_herald.data.TrainStream` is switched to read only this rank's
        slice (no other rank's sample is generated or parsed), another loader's whole global batches
        are sliced here. Input skipping drops the stale inputs of this rank's slices and refills its
        batches at a rate every rank shares (:class:`RankInputStream`: the live samples scheduling on
        had read ahead are carried over); row skipping counts each batch's stale reads. The last
        ``window`` batches fed are the threshold search's sample."""
        if isinstance(it, TrainStream):
            it.whole = False
        mine: Iterator[Batch] = self._loader(it)  # a loader's batches: every rank's checked alike
        if self.global_batches and not isinstance(it, TrainStream):
            mine = (self._my_slice(b) for b in mine)
        if self.rank_inputs is not None and self.rank_inputs.source is not it:
            left = self.live_inputs.take_left(self._loader(it)) if self.live_inputs is not None else None
            self.rank_inputs.start(it, self._my_part(left) if left is not None else None)
        step = first_step
        while True:
            try:
                comm = self.stats.comm_s
                if self.rank_inputs is not None:
                    batch = self.rank_inputs.next(mine, step)
                else:
                    batch = next(mine)
            except StopIteration:
                return
            finally:  # the own-batch check's gathers, on the training thread here: scheduler time on the path
                self.stats.scheduler_s += self.stats.comm_s - comm
            if self.skip_hook is not None and self.rank_inputs is None:
                batch = self._feature_order(batch)
                self.skip_hook.count_reads(self, torch.unique(self.batch_keys(batch.sparse_features)))
            if self.skip_hook is not None:
                self._fed_off.append(batch)
            yield batch
            step += 1

    def _loader(self, it: Iterator[Batch]) -> Iterator[Batch]:
        """``it`` checked with every rank's where it is a user's loader (not the trainer's :class:`TrainStream`,
        whose ranks read alike): one :class:`~torchrec_herald.pipeline.stages.keys.CheckedOwnBatches` over it,
        whichever mode reads it, so that the batch it reads ahead is the next one either mode trains. With
        ``global_batches`` its batches must be every rank's alike (a loader of each rank's own batches trained a
        slice of each, silently)."""
        if isinstance(it, TrainStream):
            return it
        if self._checked is None or self._checked.source is not it:
            self._checked = CheckedOwnBatches(self.env, it, whole=self.global_batches)
        return self._checked

    def _my_slice(self, batch: Batch) -> Batch:
        """This rank's contiguous share of a whole global batch (stock's split)."""
        B = batch.labels.shape[0] // self.env.world
        return select_samples(batch, torch.arange(self.env.rank * B, (self.env.rank + 1) * B))

    def _my_part(self, batch: Batch) -> Optional[Batch]:
        """This rank's contiguous part of ``batch``'s samples, split as evenly as whole samples allow
        (None if empty)."""
        n, W, r = batch.labels.shape[0], self.env.world, self.env.rank
        lo, hi = r * n // W, (r + 1) * n // W
        return select_samples(batch, torch.arange(lo, hi)) if hi > lo else None

    def _feature_order(self, batch: Batch) -> Batch:
        """``batch`` with its features in the EBC's order."""
        return Batch(dense_features=batch.dense_features, labels=batch.labels,
                     sparse_features=self.ebc.in_feature_order(batch.sparse_features))

    # ------------------------------------------------------------------ stale-update skipping's host
    @property
    def hot_keys(self) -> torch.Tensor:
        """Global keys of the hot rows, ascending."""
        return self.layout.hot_keys

    def hot_values(self) -> torch.Tensor:
        """This rank's hot replicas, every herald table's in one tensor (stale-update skipping reads them)."""
        return self.ebc.hot_values()

    def freeze_hot(self, stale: Optional[torch.Tensor], keys: torch.Tensor) -> None:
        """Stop training the hot rows ``stale`` (global keys ``keys``): the per-step path masks their
        update (``eager`` sync), the plan leaves them out of the window's reads."""
        if self.sync == "eager":  # (the mode's: scheduling off trains eagerly whatever pipeline.sync says; the
            self.ebc.set_frozen_hot(stale)  # configured value left skip=row with scheduling off training every row)
        self.ebc.set_frozen_keys(keys)

    def unfreeze_hot(self) -> None:
        """Train every hot row and key again (stale-update skipping's freeze lifted)."""
        self.ebc.set_frozen_hot(None)
        self.ebc.set_frozen_keys(torch.empty(0, dtype=torch.int64))

    def count_read(self, samples: int) -> None:
        """Input skipping that refills its batches: the data's samples read (of whole global batches)."""
        self.stats.inputs_read += samples

    def count_skipped(self, candidates: int, skipped: int, inputs: int = 0) -> None:
        """Stale-update skipping's counters: updates considered, skipped, and whole inputs skipped."""
        self.stats.candidate_updates += candidates
        self.stats.skipped_updates += skipped
        self.stats.skipped_inputs += inputs

    # ------------------------------------------------------------------ figures
    def plan_counters_all_ranks(self) -> SyncCounters:
        """The plan's counters over all ranks (collective with ``planning=by_home``, where each rank
        counts the rows it is home to; otherwise every rank already holds the global figures)."""
        if self.strategy is None:
            return self.stats.counters
        return self.strategy.plan_counters()

    def scheduling_report(self) -> Dict[str, Any]:
        """``metrics.json`` ``herald_pipeline.scheduling``: the mode, and for ``auto`` the probe's figures."""
        out: Dict[str, Any] = {"setting": self.config.scheduling, "mode": self.mode, "planning": self.config.planning,
                               "planning_reason": self.planning_reason, "allocator": self.allocator,
                               "scheduler_impl": self.env.planner.impl}
        if self.switch is not None:
            out.update(self.switch.report())
        return out

    def report(self, since: Optional[SchedulerStats] = None, step_time_s: float = 0.0) -> Dict[str, Any]:
        """``metrics.json`` ``herald_pipeline`` (collective with planning by home): the scheduler's
        figures since ``since`` (a copy of :attr:`stats` taken then; default: the start), the settings and
        the scheduling mode."""
        stats = copy.copy(self.stats)
        stats.counters = self.plan_counters_all_ranks()
        if since is not None:
            stats = stats.minus(since)
        return stats.summary(step_time_s) | {"sync": self.sync, "allocator": self.allocator, "window": self.window,
                                             "move_penalty": self.move_penalty_report(),
                                             "scheduling": self.scheduling_report()}

    def move_penalty_report(self) -> Dict[str, Any]:
        """The allocator's move penalty: ``set`` (the configured one, None: priced per batch), where priced
        the one the last per-rank batch was priced at (``priced``), and where moves must pay with one
        lookup (``allocator=auto`` on per-rank batches) the most they may be priced at (``max_priced``)."""
        report = {"set": self.move_penalty, "priced": self.env.move_penalty if self.move_penalty is None else None}
        max_priced = getattr(self._allocator_on, "max_priced", None)
        return report if max_priced is None else report | {"max_priced": max_priced}

    @property
    def plan_mode(self) -> bool:
        """The lazy plan moves the rows (the EBC's per-table traffic counters do not see its transfers)."""
        return self.lazy

    def snapshot(self) -> SchedulerStats:
        """A copy of the counters now (figures since then: ``report(since=...)``)."""
        return copy.deepcopy(self.stats)

    def approximate_report(self, since: Optional[SchedulerStats] = None) -> Dict[str, Any]:
        """What an approximate mode did since ``since``: the share of updates skipped, reads served stale,
        the largest staleness served, the skip thresholds found (``{}`` for the exact modes)."""
        if not self.config.approximate:
            return {}
        st = self.stats if since is None else self.stats.minus(since)
        steps = max(st.steps, 1)
        return {"staleness": self.config.staleness, "skip": self.config.skip,
                "stale_read_share": st.stale_reads / max(st.counters.reads, 1),
                "stale_reads_per_step": st.stale_reads / steps, "max_staleness": st.max_staleness,
                "skipped_update_share": st.skipped_updates / max(st.candidate_updates, 1),
                "skipped_inputs_per_step": st.skipped_inputs / steps,
                # input skipping that refills its batches: the data's samples read per step (all ranks; trained
                # or skipped)
                "data_samples_per_step": st.inputs_read / steps if st.inputs_read else None,
                "skip_thresholds": [list(h) for h in (self.skipper.history if self.skipper else [])],
                # input skipping that refills: each search's verdict, [step, paused, classifier ms per step,
                # step ms, skip share] (paused: it cost more time than it saved)
                "skip_verdicts": [list(v) for v in (self.skip_hook.verdicts if self.skip_hook else [])]}

    def prepare_checkpoint(self) -> bool:
        """Before a save: flush and forget the window (:meth:`reset_window`); the data iterator restarts at
        the saved position."""
        self.reset_window()
        return True

    def scheduler_seconds(self, since: Optional[SchedulerStats] = None) -> tuple[float, float]:
        """Scheduling seconds since ``since``: (on the critical path, its collectives excluded; done ahead
        by the run-ahead thread)."""
        s = self.stats if since is None else self.stats.minus(since)
        return s.scheduler_s - s.comm_s, s.ahead_s

    # ------------------------------------------------------------------ checkpoints
    def reset_window(self) -> None:
        """Flush (collective) and forget the window: the batches read ahead into it are dropped, and the next
        :meth:`progress` refills it from the iterator it is given, which must start at the checkpoint's data
        position (the batch after the ``stats.steps`` trained; the iterator given so far has been read past
        it). The next batch is allocated as the ``stats.steps``-th. A run resumed from a checkpoint taken here
        trains like one never stopped."""
        self._cancel_ahead()
        if self.switch is not None:
            self.switch.drop_delegate()
        self.flush()
        self._queue.clear()
        self._exhausted = self._started = False
        self._refill = True
        self.env.alloc_step = self.stats.steps

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the pipeline (JSON-able): its counters; take it after
        :meth:`reset_window`."""
        if self._queue:
            raise RuntimeError(f"HeraldTrainPipeline.state_dict with {len(self._queue)} batch(es) read ahead into the "
                               f"window: a checkpoint is taken at a window boundary. Call reset_window() (it drops "
                               f"them), then give progress() an iterator that starts at the batch after the "
                               f"{self.stats.steps} trained (stats.steps), as the trainer does at each checkpoint")
        probe = self.switch.probe if self.switch is not None else self._restored_probe
        return {"stats": asdict(self.stats), "alloc_step": self.env.alloc_step, "mode": self.mode, "probe": probe}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s counters (the planner starts from the flushed layout, as saved).
        ``None``: the checkpoint's run trained with TorchRec's pipeline (the model of time had picked a stock
        plan then: each attempt measures its link): the counters start at zero."""
        if state is None:
            logger.info("the checkpoint holds no herald pipeline state (its run trained a stock plan): "
                        "herald's counters start at zero")
            return
        stats = dict(state["stats"])
        stats["counters"] = SyncCounters(**stats["counters"])
        self.env.stats = SchedulerStats(**stats)
        self.env.alloc_step = int(state["alloc_step"])
        self._refill = True
        if "mode" in state:
            self.mode, self._restored_probe = state["mode"], state["probe"]
            self._apply_mode()
            if self.switch is not None:
                self.switch.restore(self._restored_probe)

    # ------------------------------------------------------------------ end of training
    def flush(self) -> None:
        """Push every dirty row home, refresh outdated hot replicas, drop the caches (collective): the
        model is then in herald's stock layout (for eval, ``state_dict``, a stock pipeline)."""
        if self._flushed:
            return
        self._collect_ahead()
        for ctx in self._queue:  # a plan made ahead for a batch that will not train now: run it without gradients
            if ctx.plan is not None:
                plan, ctx.plan = ctx.plan, None
                self.ebc.drain_plan(plan)
        self.ebc.flush_plan(self.planner.flush())
        self._flushed = True

    def end_turn(self) -> None:
        """Another run trains next in these ranks (``compare_with``'s turns): the step that just trained ends here
        for ``scheduling=auto``'s probe and input skipping's search (they time a step from its start to the next
        step's: that would hold the other run's turn), and the run-ahead job in flight finishes (its batch and plan
        kept for the next step; the wait counted as a step's wait for it), so none of this run's scheduling runs in
        the other's turn."""
        if self.switch is not None:
            self.switch.stop_clock()
        if self.skip_hook is not None:
            self.skip_hook.stop_clock()
        if self._ahead is not None:
            self._waited_ahead(self._ahead.wait_finished())

    def _waited_ahead(self, seconds: float) -> None:
        """A step waited ``seconds`` for the run-ahead job: scheduling on the critical path."""
        self.stats.wait_ahead_s += seconds
        self.stats.scheduler_s += seconds

    def detach(self) -> nn.Module:
        """Flush and hand back the model (as ``TrainPipelineSparseDist.detach``); hot rows frozen by
        stale-update skipping are trained again (the herald EBC would otherwise keep them frozen)."""
        self._cancel_ahead()
        if self.switch is not None:
            self.switch.drop_delegate()
        self.flush()
        if self._ahead is not None:
            self._ahead.shutdown()
            self._ahead = None
        if self.skip_hook is not None:
            self.skip_hook.detach(self)
        return self._model
