"""HeraldTrainPipeline: Herald's embedding scheduling as a TorchRec train pipeline (docs/design.md §3, Herald).

A look-ahead window of the next K global batches feeds (1) the location-aware input allocator, which
moves samples to the rank that holds their rows, and (2) the lazy, exact communication plan over worker
caches and hot replicas (a :class:`~torchrec_herald.plans.CommPlanner`), which the herald EBC executes
(:class:`~torchrec_herald.sharding.plan_exec.PlanExecutor`). Drop-in for ``TrainPipelineSparseDist``:
same constructor arguments, ``progress(dataloader_iter)``. Opt-in approximate modes: HET's bounded
staleness (``staleness=s``) and Slipstream's stale-update skipping (``skip=SkipConfig(...)``, a hook).

Each batch entering the window runs the named stages :meth:`~HeraldTrainPipeline.key_batch` (validate,
global keys), :meth:`~HeraldTrainPipeline.allocate_batch` (score, assign, move samples),
:meth:`~HeraldTrainPipeline.collect_reads` (every rank's rows); each step then runs
:meth:`~HeraldTrainPipeline.plan_step` and :meth:`~HeraldTrainPipeline.train_step`. A batch's state between
stages is its :class:`HeraldBatchContext` (a TorchRec ``TrainPipelineContext``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineContext, TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.comm import all_gather_varlen, all_to_all_rows
from torchrec_herald.data import TrainStream
from torchrec_herald.layout import cache_rows_for_budget
from torchrec_herald.ops.hot_cold import first_invalid_id
from torchrec_herald.pipeline.home_split import HomeSplitLazyPlanner
from torchrec_herald.pipeline.input_allocator import build_allocator
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.pipeline.options import ALLOCATORS, CACHE_POLICIES, SYNC_MODES, HeraldPipelineConfig
from torchrec_herald.pipeline.stale_skip import SkipConfig, StaleSkipHook
from torchrec_herald.pipeline.staleness import StalenessPlanner
from torchrec_herald.plans import CommPlanner, SyncCounters
from torchrec_herald.traffic import traffic_tag

logger = logging.getLogger(__name__)

#: batches ``TrainPipelineSparseDist`` holds beyond the one it trains (input dist started, copied)
_SPARSE_DIST_AHEAD = 2

__all__ = ["ALLOCATORS", "CACHE_POLICIES", "SYNC_MODES", "HeraldBatchContext", "HeraldTrainPipeline", "SchedulerStats"]


@dataclass
class HeraldBatchContext(TrainPipelineContext):
    """One global batch in the window: this rank's share after allocation, every rank's reads."""

    batch: Optional[Batch] = None
    keys: Optional[torch.Tensor] = None  # global key of each id of ``batch`` (None: a bad id was found)
    reads: List[torch.Tensor] = field(default_factory=list)  # per rank: sorted unique keys read
    moved: int = 0  # samples of the global batch the allocator moved
    bad: Tuple[int, int, int] = (0, 0, 0)  # (1, feature, id) of this rank's first id outside its table
    sample_of_key: Optional[torch.Tensor] = None  # sample of each key, before allocation
    rank_of: Optional[torch.Tensor] = None  # global batches: the rank each sample was assigned to
    plan: Any = None  # run-ahead: this batch's plan, made while the previous step trained


@dataclass
class SchedulerStats:
    """Per-run totals of the scheduler (``metrics.json`` ``herald_pipeline``)."""

    steps: int = 0
    counters: SyncCounters = field(default_factory=SyncCounters)
    moved_samples: int = 0
    local_lookups: int = 0
    lookups: int = 0
    skipped_inputs: int = 0  # stale-update skipping, input granularity: samples not trained
    skipped_updates: int = 0  # (sample lookups | row reads) whose update was skipped
    candidate_updates: int = 0  # the same, all of them (while a classification was active or not)
    stale_reads: int = 0  # bounded staleness: reads served by a copy 1..s versions behind
    max_staleness: int = 0  # the largest lag served
    scheduler_s: float = 0.0  # on the critical path: allocation + sample/reads exchange + planning, incl. their
    # collectives, and waiting for the run-ahead thread
    ahead_s: float = 0.0  # run-ahead thread: scheduling done while steps trained (off the critical path)
    wait_ahead_s: float = 0.0  # of scheduler_s: the step waiting for the run-ahead thread
    comm_s: float = 0.0  # of which inside the scheduler's collectives (transfer + waiting for other ranks)
    planner_s: float = 0.0  # of which planning

    def minus(self, earlier: "SchedulerStats") -> "SchedulerStats":
        """What happened since ``earlier`` (a copy taken then): every total less ``earlier``'s, the largest
        staleness kept (a resumed run's figures cover its own attempt)."""
        out = SchedulerStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                                for f in fields(self) if f.name not in ("counters", "max_staleness")})
        out.counters = SyncCounters(**{f.name: getattr(self.counters, f.name) - getattr(earlier.counters, f.name)
                                       for f in fields(self.counters)})
        out.max_staleness = self.max_staleness
        return out

    def summary(self, step_time_s: float) -> Dict[str, float]:
        n = max(self.steps, 1)
        c = self.counters
        out = {k: getattr(c, k) / n for k in ("miss_pull", "update_pull", "update_push", "miss_push", "reduce")}
        out.update(hit_rate=c.hit_rate, cache_hit_rate=c.cache_hit_rate, plan_transfers_per_step_all_ranks=c.vectors / n,
                   moved_samples_per_step=self.moved_samples / n,
                   local_lookup_share=self.local_lookups / max(self.lookups, 1),
                   scheduler_ms_per_step=1000 * self.scheduler_s / n, planner_ms_per_step=1000 * self.planner_s / n,
                   scheduler_comm_ms_per_step=1000 * self.comm_s / n,
                   scheduler_overlapped_ms_per_step=1000 * self.ahead_s / n,
                   scheduler_wait_ahead_ms_per_step=1000 * self.wait_ahead_s / n,
                   stale_reads_per_step=self.stale_reads / n, stale_read_share=self.stale_reads / max(c.reads, 1),
                   max_staleness=self.max_staleness,
                   scheduler_compute_ms_per_step=1000 * (self.scheduler_s - self.comm_s) / n,
                   scheduler_share_of_step=(self.scheduler_s / n) / step_time_s if step_time_s > 0 else 0.0,
                   scheduler_compute_share_of_step=((self.scheduler_s - self.comm_s) / n) / step_time_s
                   if step_time_s > 0 else 0.0)
        return out


class _CommTimer:
    """Adds the wall time of its block to ``stats.comm_s`` (and tags the collectives for TrafficMeter)."""

    def __init__(self, stats: SchedulerStats, label: str) -> None:
        self.stats, self.tag = stats, traffic_tag(label)

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.tag.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.tag.__exit__(*exc)
        self.stats.comm_s += time.perf_counter() - self.t0


def _pack_int16(scores: torch.Tensor) -> torch.Tensor:
    """int64 view of ``scores`` as int16 (clamped), zero-padded to a multiple of 4: 2 bytes per score."""
    flat = scores.flatten().clamp(max=32767).to(torch.int16)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)])
    return flat.view(torch.int64)


def _unpack_int16(packed: torch.Tensor, n: int) -> torch.Tensor:
    return packed.contiguous().view(torch.int16)[:n].to(torch.int64)


def select_samples(batch: Batch, index: torch.Tensor) -> Batch:
    """The samples ``index`` of ``batch`` (in that order): dense rows, labels and every feature's bags.
    By hand: fbgemm's ``keyed_jagged_index_select_dim1`` has no CPU kernel in fbgemm-gpu-cpu 1.8."""
    kjt = batch.sparse_features
    G, F = kjt.stride(), len(kjt.keys())
    lengths = kjt.lengths().view(F, G).index_select(1, index).reshape(-1)
    starts = kjt.offsets()[:-1].view(F, G).index_select(1, index).reshape(-1)
    ends = torch.cumsum(lengths, 0)
    pos = torch.repeat_interleave(starts - (ends - lengths), lengths) + torch.arange(int(ends[-1]) if ends.numel() else 0)
    return Batch(dense_features=batch.dense_features.index_select(0, index),
                 sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().index_select(0, pos),
                                                   lengths=lengths),
                 labels=batch.labels.index_select(0, index))


def find_herald_ebc(model: nn.Module) -> Any:
    """The one herald-sharded EBC inside ``model`` (a DMP)."""
    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

    found = [m for m in model.modules() if isinstance(m, ShardedHeraldEmbeddingBagCollection)]
    if len(found) != 1:
        raise ValueError(f"HeraldTrainPipeline needs a model with exactly one EmbeddingBagCollection sharded by "
                         f"HeraldEmbeddingBagCollectionSharder (planner=herald); found {len(found)}")
    return found[0]


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
            ``move_penalty``, ``staleness``, ``skip``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 execute_all_batches: bool = True, apply_jit: bool = False, *,
                 config: Optional[HeraldPipelineConfig] = None, **options: Any) -> None:
        self.config = config if config is not None else HeraldPipelineConfig(**options)
        if config is not None and options:
            raise ValueError(f"pass either config or keyword options, not both (got {sorted(options)})")
        super().__init__()
        c = self.config
        self._model, self._optimizer, self._device = model, optimizer, device
        self.window, self.allocator, self.sync, self.move_penalty = c.window, c.allocator, c.sync, c.move_penalty
        self.staleness = c.staleness
        self.ebc = find_herald_ebc(model)
        self._pg = self.ebc.process_group
        self._W, self._rank = self.ebc.world_size, self.ebc.rank
        self.layout = self.ebc.layout
        capacity_rows = (None if c.cache_bytes is None else  # the store keeps a cached row's weights + state
                         cache_rows_for_budget(self.layout, c.cache_bytes, (self.ebc.embedding_dim + 1) * 4))
        self.by_home = c.planning == "by_home"
        self.planner: CommPlanner = (
            HomeSplitLazyPlanner(self.layout, self._rank, self._exchange_words, c.cache_fraction, c.window,
                                 capacity_rows) if self.by_home
            else TensorLazySyncPlanner(self.layout, c.cache_fraction, c.window, capacity_rows) if c.staleness is None
            else StalenessPlanner(self.layout, c.staleness, c.cache_fraction, c.window, capacity_rows))
        self.input_allocator = build_allocator(c.allocator, **({"move_penalty": c.move_penalty}
                                                               if c.allocator == "greedy" else {}))
        if c.skip is not None and self.layout.num_hot == 0:
            raise ValueError("pipeline.skip needs hot replication: this plan has no hot rows (use planner=herald "
                             "with a hot-set budget that holds some rows)")
        self.skip_hook = StaleSkipHook(c.skip_config, self.layout.num_hot) if c.skip is not None else None
        self._queue: Deque[HeraldBatchContext] = deque()
        self._exhausted = False
        self._started = False
        self._flushed = True
        self._alloc_step = 0
        self._batch_index = 0
        self._refill = False  # the window restarts mid-data (a checkpoint): running dry is not an error
        self.stats = SchedulerStats()
        #: decided by :meth:`_resolve` from the first data loader (``config.resolve``)
        self.global_batches: Optional[bool] = None
        self.run_ahead: Optional[bool] = None
        self._ahead: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        #: set before a :meth:`progress` after which :meth:`reset_window` is called (a checkpoint): that
        #: step's run-ahead job then plans nothing ahead (else the flush first runs that plan without
        #: gradients, which changes no value but counts its transfers)
        self.reset_after_step = False
        # pipeline.scheduling: "on"/"off", or "auto" = time both modes on the first steps, keep the faster
        self._allocator_on = self.input_allocator
        self._allocator_off = build_allocator("identity")
        self.mode = "off" if c.scheduling == "off" else "on"
        self._reads_needed = c.sync == "lazy" and c.scheduling != "off"
        self._apply_mode()
        self.probe: Optional[Dict[str, Any]] = None
        self._step_started: Optional[float] = None
        # scheduling off for good ("off", or "auto" decided off): hot replication alone runs under TorchRec's
        # own TrainPipelineSparseDist (its input dist overlapped with compute), fed this rank's samples
        self._delegate: Optional[TrainPipelineSparseDist] = None
        self._delegate_src: Optional[Iterator[Batch]] = None
        self._delegate_it: Optional[Iterator[Batch]] = None

    @property
    def skipper(self) -> Any:
        """The stale-update skipper's per-run state (None when skipping is off)."""
        return self.skip_hook.skipper if self.skip_hook is not None else None

    def _resolve(self, it: Iterator[Batch]) -> None:
        """Decide ``global_batches``, ``run_ahead`` and ``scheduling`` for the first data loader (a
        TrainStream can read whole global batches; another loader gives this rank's batches, unless
        ``global_batches=True`` says they are whole), once."""
        if self.global_batches is not None:
            return
        config, why = self.config.resolve(whole_batches=isinstance(it, TrainStream))
        for line in why:
            logger.info("%s", line)
        self.config = config
        self.global_batches, self.run_ahead = bool(config.global_batches), bool(config.run_ahead)
        # run-ahead: one worker thread; at most one batch in flight, handed over before the next plan_step
        self._ahead = ThreadPoolExecutor(1, "herald-ahead") if self.run_ahead else None
        if config.scheduling == "auto" and self.probe is None:  # (a resumed run restored its probe)
            self.probe = {"seconds": {"on": 0.0, "off": 0.0}, "steps": {"on": 0, "off": 0}, "decided": False}

    # ------------------------------------------------------------------ window
    def fill(self, it: Iterator[Batch]) -> None:
        """Read batches until the window holds ``window`` of them, running each through the stages."""
        self._resolve(it)
        self._collect_ahead()
        while not self._exhausted and len(self._queue) < self.window:
            t0 = time.perf_counter()
            ctx = self.schedule_next(it)
            self.stats.scheduler_s += time.perf_counter() - t0
            if ctx is None:
                if not self._started and not self._refill:
                    raise ValueError(f"pipeline.window={self.window} is larger than the {len(self._queue)} "
                                     f"batch(es) the data loader has left; lower pipeline.window")
                break
            self._queue.append(ctx)
        self._started = True
        self._refill = False

    def schedule_next(self, it: Iterator[Batch]) -> Optional[HeraldBatchContext]:
        """Read the next batch and run it through the stages (key, allocate, reads); None (and the
        window marked exhausted) when the loader is dry."""
        try:
            raw = next(it)
        except StopIteration:
            self._exhausted = True
            return None
        ctx = HeraldBatchContext(index=self._batch_index)
        self._batch_index += 1
        self.key_batch(ctx, raw)
        self.allocate_batch(ctx)
        if self.skip_hook is not None and self.skip_hook.granularity == "input":
            before = ctx.batch.labels.numel()
            ctx.batch = self.skip_hook.filter_inputs(self, ctx.batch, self.stats.steps + len(self._queue))
            if ctx.batch.labels.numel() != before:
                ctx.keys = self.batch_keys(ctx.batch.sparse_features)
        self.collect_reads(ctx)
        return ctx

    def _schedule_ahead(self, it: Iterator[Batch], plan_ahead: bool) -> Optional[HeraldBatchContext]:
        """The run-ahead job, while step t trains: batch t+K enters the window (allocated under the
        planner's state after plan t, as in the serial order), then plan t+1 is made from the window.
        It only reads the window; the step takes its batch in :meth:`_collect_ahead`."""
        t0 = time.perf_counter()
        try:
            ctx = self.schedule_next(it)
            window = list(self._queue) + ([ctx] if ctx is not None else [])
            if plan_ahead and window and self.sync == "lazy":
                window[0].plan = self._make_plan(window)
            return ctx
        finally:
            self.stats.ahead_s += time.perf_counter() - t0

    def _collect_ahead(self) -> None:
        """Take the run-ahead thread's batch into the window (waiting for it if it is not done; its
        errors, e.g. a bad id, are raised here, on every rank alike)."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        ctx = pending.result()
        waited = time.perf_counter() - t0
        self.stats.wait_ahead_s += waited
        self.stats.scheduler_s += waited
        if ctx is not None:
            self._queue.append(ctx)

    def _cancel_ahead(self) -> None:
        """Wait for the run-ahead thread and drop its batch (the window restarts from a new iterator)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception:  # noqa: BLE001 - the batch is dropped; a restarted window re-reads it
                logger.debug("dropped run-ahead batch raised", exc_info=True)

    def window_batches(self) -> List[Batch]:
        """This rank's batches in the window (after allocation), oldest first."""
        return [ctx.batch for ctx in self._queue]

    def batch_keys(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Global row key of every id of ``kjt``."""
        kjt = self.ebc.in_feature_order(kjt)
        return self.ebc.global_keys(kjt.values().to(torch.int64), kjt.lengths(), kjt.stride())

    # ------------------------------------------------------------------ stages of a batch entering the window
    def key_batch(self, ctx: HeraldBatchContext, raw: Batch) -> None:
        """Stage 1: the batch on CPU in the EBC's feature order, its ids validated, their global keys."""
        if raw.labels.device.type != "cpu":  # scheduling runs on CPU: a batch the loader put on the device comes back
            raw = raw.to(torch.device("cpu"))
        kjt = self.ebc.in_feature_order(raw.sparse_features)
        B = kjt.stride()
        values, lengths = kjt.values().to(torch.int64), kjt.lengths().to(torch.int64)
        lay = self.layout
        # the id check and the keys from one bag index per id (which also gives its sample)
        bag = torch.repeat_interleave(lengths)
        feature = bag // B
        invalid = (values < 0) | (values >= lay.rows_per_feature.index_select(0, feature))
        bad = first_invalid_id(values, lengths, lay.rows_per_feature, B) if bool(invalid.any()) else None
        if bad and self.global_batches:  # every rank sees the same global batch: all raise the same error
            local_batch = B // self._W
            ranks = torch.unique((bag % B)[invalid] // local_batch).tolist()
            raise self.ebc.bad_id_error(ranks, bad[0], bad[1])
        ctx.batch = Batch(dense_features=raw.dense_features, sparse_features=kjt, labels=raw.labels)
        ctx.keys = None if bad else lay.feature_offsets.index_select(0, feature) + values
        ctx.bad = (1, bad[0], bad[1]) if bad else (0, 0, 0)
        ctx.sample_of_key = bag % B

    def allocate_batch(self, ctx: HeraldBatchContext) -> None:
        """Stage 2 (collective): every rank's id errors and own samples' local-lookup scores are
        all-gathered, the allocator assigns the global batch, samples move to their ranks."""
        assert ctx.batch is not None
        if self.global_batches:
            self._allocate_global(ctx)
            return
        kjt = ctx.batch.sparse_features
        B = kjt.stride()
        scored = self.input_allocator.needs_scores
        err = torch.tensor([*ctx.bad, kjt.values().numel()], dtype=torch.int64)
        if scored and ctx.keys is not None:
            # local: a hot replica, this rank's block or a valid cache entry under the planner's state
            scores = self.planner.local_scores(ctx.keys, ctx.sample_of_key, B)
        else:
            scores = torch.zeros(B, self._W, dtype=torch.int64)
        meta = torch.cat([err, _pack_int16(scores)]) if scored else err
        gathered = torch.empty(self._W * meta.numel(), dtype=torch.int64)
        with _CommTimer(self.stats, "herald_schedule_meta"):
            dist.all_gather_into_tensor(gathered, meta, group=self._pg)
        gathered = gathered.view(self._W, -1)
        self._raise_on_bad(gathered[:, :3])
        nnz = int(gathered[:, 3].sum())
        if not scored:
            return
        all_scores = torch.cat([_unpack_int16(g, B * self._W) for g in gathered[:, 4:]]).view(self._W * B, self._W)
        rank_of = self.input_allocator.assign_scores(all_scores, self._alloc_step)
        self._alloc_step += 1
        ctx.moved = int((rank_of != torch.arange(self._W * B) // B).sum())
        self.stats.local_lookups += int(all_scores.gather(1, rank_of[:, None]).sum())
        self.stats.lookups += nnz
        if ctx.moved:
            ctx.batch = self._exchange_samples(ctx.batch, rank_of[self._rank * B:(self._rank + 1) * B],
                                               (rank_of == self._rank).nonzero().flatten())
            ctx.keys = self.batch_keys(ctx.batch.sparse_features)

    def _allocate_global(self, ctx: HeraldBatchContext) -> None:
        """Stage 2 on a global batch, on this rank alone: score every sample for every rank (the
        planner's state is the same everywhere), assign, keep this rank's samples (in global order)."""
        assert ctx.batch is not None and ctx.keys is not None and ctx.sample_of_key is not None
        G, W = ctx.batch.sparse_features.stride(), self._W
        if G % W:
            raise ValueError(f"pipeline.global_batches: a global batch of {G} samples does not split over {W} ranks")
        loaded_on = torch.arange(G) // (G // W)  # stock's contiguous split
        if self.input_allocator.needs_scores:
            scores = self.planner.local_scores(ctx.keys, ctx.sample_of_key, G)
            rank_of = self.input_allocator.assign_scores(scores, self._alloc_step)
            self._alloc_step += 1
            self.stats.local_lookups += int(scores.gather(1, rank_of[:, None]).sum())
            self.stats.lookups += ctx.keys.numel()
        else:
            rank_of = loaded_on
        ctx.moved = int((rank_of != loaded_on).sum())
        ctx.rank_of = rank_of
        mine = (rank_of == self._rank).nonzero().flatten()
        ctx.batch = select_samples(ctx.batch, mine)

    def collect_reads(self, ctx: HeraldBatchContext) -> None:
        """Stage 3 (collective, lazy sync only): every rank's sorted unique read keys (int32 on the wire).
        With global batches every rank's reads come from the assignment: no collective."""
        if self.global_batches:
            assert ctx.keys is not None and ctx.rank_of is not None and ctx.sample_of_key is not None
            key_rank = ctx.rank_of.index_select(0, ctx.sample_of_key)
            mine = key_rank == self._rank
            if self._reads_needed:  # also while scheduling is off: "auto" may turn it back on
                n = self.layout.num_rows
                both = torch.from_numpy(np.unique((key_rank * n + ctx.keys).numpy()))  # sorted, by rank then key
                per_rank = torch.bincount(both // n, minlength=self._W).tolist()
                ctx.reads = [part - r * n for r, part in enumerate(both.split(per_rank))]
            ctx.keys = ctx.keys[mine]  # this rank's samples' keys, in its batch's order
            ctx.rank_of = ctx.sample_of_key = None
            return
        if self.sync != "lazy":
            return
        assert ctx.keys is not None
        # = torch.unique(keys); numpy's sort is several times faster than torch's on CPU
        mine = torch.unique_consecutive(torch.from_numpy(np.sort(ctx.keys.numpy())))
        if self.by_home:  # the keys go to their homes when the step is planned
            ctx.reads = [mine[:0]] * self._W
            ctx.reads[self._rank] = mine
            return
        ctx.reads = [k.to(torch.int64) for k in self.gather_varlen(mine.to(torch.int32), "herald_schedule_meta")]

    def _exchange_words(self, send: List[torch.Tensor]) -> List[torch.Tensor]:
        """Planning by home: one int64 tensor to each rank, one from each (two all-to-alls: sizes, words)."""
        with _CommTimer(self.stats, "herald_schedule_meta"):
            sizes = torch.tensor([t.numel() for t in send], dtype=torch.int64)
            recv = all_to_all_rows(sizes, [1] * self._W, [1] * self._W, self._pg, "herald_schedule_meta")
            out = all_to_all_rows(torch.cat(send), sizes.tolist(), recv.tolist(), self._pg, "herald_schedule_meta")
        return list(out.split(recv.tolist()))

    def gather_varlen(self, mine: torch.Tensor, label: str) -> List[torch.Tensor]:
        """Every rank's ``mine`` (:func:`~torchrec_herald.comm.all_gather_varlen`), timed as scheduler comm."""
        with _CommTimer(self.stats, label):
            return all_gather_varlen(mine, self._pg, label)

    def _raise_on_bad(self, errs: torch.Tensor) -> None:
        bad = (errs[:, 0] > 0).nonzero().flatten().tolist()
        if bad:
            raise self.ebc.bad_id_error(bad, int(errs[bad[0], 1]), int(errs[bad[0], 2]))

    def _exchange_samples(self, batch: Batch, dest: torch.Tensor, incoming: torch.Tensor) -> Batch:
        """Send each local sample to ``dest[i]`` (dense, label, per-feature lengths, ids); receive the
        samples ``incoming`` (global indices, ascending) in global order. Two all-to-alls."""
        W, B = self._W, dest.numel()
        kjt = batch.sparse_features
        F = len(kjt.keys())
        lengths = kjt.lengths().to(torch.int64).view(F, B)
        order = torch.argsort(dest, stable=True)  # samples grouped by destination, in index order
        fixed = torch.cat([batch.dense_features.float().view(torch.int32), batch.labels.float().view(-1, 1).view(
            torch.int32), lengths.T.to(torch.int32)], 1)  # [B, dense + 1 + F]
        send_counts = torch.bincount(dest, minlength=W)
        src_of_in = incoming // B
        recv_counts = torch.bincount(src_of_in, minlength=W)

        def regroup(ids: torch.Tensor, bag_len: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
            """``ids`` in bags of ``bag_len``, the bags rearranged so that bag b comes ``slot[b]``-th (what a
            stable argsort of the ids by their bag's slot gives, by offsets: no sort)."""
            if ids.numel() == bag_len.numel() and bool((bag_len == 1).all()):  # one id per bag: slot is its place
                return torch.empty_like(ids).index_copy_(0, slot, ids)
            slot_len = torch.empty_like(bag_len).index_copy_(0, slot, bag_len)
            shift = (torch.cumsum(slot_len, 0) - slot_len).index_select(0, slot) - (torch.cumsum(bag_len, 0) - bag_len)
            to = torch.repeat_interleave(shift, bag_len) + torch.arange(ids.numel())
            return torch.empty_like(ids).index_copy_(0, to, ids)

        # ids sample-major in send order: bag (feature f, sample s) goes to slot (position of s in order, f)
        pos = torch.empty_like(order).index_copy_(0, order, torch.arange(B))
        slot = pos * F + torch.arange(F)[:, None]
        ids_out = regroup(kjt.values().to(torch.int32), lengths.flatten(), slot.view(-1))
        ids_send = torch.zeros(W, dtype=torch.int64).index_add_(0, dest, lengths.sum(0)).tolist()
        with _CommTimer(self.stats, "herald_samples"):
            fixed_in = all_to_all_rows(fixed[order], send_counts.tolist(), recv_counts.tolist(), self._pg,
                                       "herald_samples")
            lengths_in = fixed_in[:, -F:].to(torch.int64)  # [n_in, F], samples in ascending global order
            ids_recv = torch.zeros(W, dtype=torch.int64).index_add_(0, src_of_in, lengths_in.sum(1)).tolist()
            # ids < 2**31: int32 on the wire
            ids_in = all_to_all_rows(ids_out, ids_send, ids_recv, self._pg, "herald_samples")
        n_dense = batch.dense_features.shape[1]
        dense = fixed_in[:, :n_dense].view(torch.float32).to(batch.dense_features.dtype)
        labels = fixed_in[:, n_dense].view(torch.float32).to(batch.labels.dtype)
        # back to the feature-major KJT layout: bag (sample s, feature f) goes to slot (f, s)
        n_in = lengths_in.shape[0]
        new_values = regroup(ids_in, lengths_in.flatten(), torch.arange(F * n_in).view(F, n_in).T.reshape(-1))
        new_kjt = KeyedJaggedTensor(keys=kjt.keys(), values=new_values.to(kjt.values().dtype),
                                    lengths=lengths_in.T.flatten().to(kjt.lengths().dtype))
        return Batch(dense_features=dense, sparse_features=new_kjt, labels=labels)

    # ------------------------------------------------------------------ stages of a step
    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """Train one global batch; returns the model's output (as ``TrainPipelineSparseDist`` does).

        Raises:
            StopIteration: the loader and the window are empty (copies flushed first).
            ValueError: the first window cannot be filled (``window`` > batches left), bad ids (every rank).
        """
        self._resolve(dataloader_iter)
        self._auto_schedule()
        if self.mode == "off":
            return self._delegate_progress(dataloader_iter)
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
        if self._ahead is not None and not self._exhausted:
            # the next batch enters the window (allocated under the state after this plan) while this step trains
            self._pending = self._ahead.submit(self._schedule_ahead, dataloader_iter,
                                               self.skip_hook is None and not self.reset_after_step)
        self.reset_after_step = False
        return self.train_step(head)

    # ------------------------------------------------------------------ pipeline.scheduling=auto
    def _apply_mode(self) -> None:
        """``on``: the configured allocator and sync; ``off``: hot replication alone (samples stay where
        loaded, herald's per-step path)."""
        on = self.mode == "on"
        self.sync = self.config.sync if on else "eager"
        self.input_allocator = self._allocator_on if on else self._allocator_off

    def _probe_phase(self, step: int) -> Tuple[str, bool]:
        """(mode, timed) of ``step`` in the probe: ``w`` unmeasured then ``p`` timed steps with scheduling
        on, then the same with it off under TorchRec's pipeline, plus the steps that drain the batches it
        holds ahead (``p = probe_steps``, ``w = p // 2``). Both modes are timed as they would then run."""
        w, p = self.config.probe_steps // 2, self.config.probe_steps
        if step < w + p:
            return "on", step >= w
        return "off", w <= step - (w + p) < w + p

    def _probe_length(self) -> int:
        """Steps the probe runs: ``2 · (w + p)`` and the off mode's drain."""
        return 2 * (self.config.probe_steps // 2 + self.config.probe_steps) + _SPARSE_DIST_AHEAD

    def _auto_schedule(self) -> None:
        """Before a step: time the previous one into its mode; switch modes on the probe's schedule; after
        the probe, keep the faster mode (the slowest rank's mean step time decides, the same on every rank)."""
        now = time.perf_counter()
        probe, step = self.probe, self.stats.steps
        if probe is None or probe["decided"]:
            return
        last, self._step_started = self._step_started, now
        if last is not None and step >= 1:
            mode, timed = self._probe_phase(step - 1)
            if timed:
                probe["seconds"][mode] += now - last
                probe["steps"][mode] += 1
        if step < self._probe_length():
            want = self._probe_phase(step)[0]
            if want != self.mode:
                self._switch(want)
            return
        means = torch.tensor([probe["seconds"][m] / max(probe["steps"][m], 1) for m in ("on", "off")],
                             dtype=torch.float64)
        dist.all_reduce(means, op=dist.ReduceOp.MAX, group=self._pg)
        on_ms, off_ms = (1000 * float(x) for x in means)
        probe.update(decided=True, on_ms_per_step=on_ms, off_ms_per_step=off_ms)
        self._drop_delegate()  # the probe's delegate trained exactly its share of batches: it is empty
        best = self._probe_decision(on_ms, off_ms)
        logger.info("pipeline.scheduling=auto: %.1f ms/step with scheduling on, %.1f with it off (hot replication "
                    "alone) -> %s%s", on_ms, off_ms, best,
                    "" if best == "on" else ": scheduling costs more time than it saves on this link and machine")
        if best != self.mode:
            self._switch(best)
        if best == "off":  # for good: the window's batches no longer need every rank's reads
            self._reads_needed = False

    @staticmethod
    def _probe_decision(on_ms: float, off_ms: float) -> str:
        """The mode ``auto`` keeps: the one with the shorter mean step (scheduling on when equal)."""
        return "on" if on_ms <= off_ms else "off"

    def _switch(self, mode: str) -> None:
        """Change mode between steps (every rank at the same step): turning the plan off flushes it."""
        if mode == "on":
            self._drop_delegate()
        self._collect_ahead()
        if self.mode == "on" and self.sync == "lazy":
            self.flush()
        self.mode = mode
        self._apply_mode()

    def _delegate_progress(self, it: Iterator[Batch]) -> Any:
        """One step of hot replication alone under TorchRec's ``TrainPipelineSparseDist``: first the
        window's batches (this rank's share, already read), then this rank's slice of each global batch.
        While ``auto`` probes, it is fed exactly the batches of the probe's remaining steps, so it is empty
        when the probe decides (whichever mode wins, no batch is skipped or trained twice)."""
        if self._delegate is None:
            self._collect_ahead()
            self.flush()
            self._delegate = TrainPipelineSparseDist(self._model, self._optimizer, self._device)
        if self._delegate_src is not it:
            queued = [ctx.batch for ctx in self._queue]
            self._queue.clear()
            probing = self.probe is not None and not self.probe["decided"]
            limit = self._probe_length() - self.stats.steps if probing else None
            self._delegate_src, self._delegate_it = it, islice(self._my_share(queued, it), limit)
        try:
            out = self._delegate.progress(self._delegate_it)
        except StopIteration:
            self._delegate_src = self._delegate_it = None
            raise
        self.stats.steps += 1
        return out

    def _my_share(self, queued: List[Any], it: Iterator[Batch]) -> Iterator[Batch]:
        """The window's batches, then this rank's slice of each global batch ``it`` yields: a
        :class:`~torchrec_herald.data.TrainStream` is switched to read only the slice (no other rank's
        sample is generated or parsed into a batch); another iterator's whole batches are sliced here."""
        yield from queued
        if isinstance(it, TrainStream):
            it.whole = False
            yield from it
            return
        for batch in it:
            if self.global_batches:
                B = batch.sparse_features.stride() // self._W
                batch = select_samples(batch, torch.arange(self._rank * B, (self._rank + 1) * B))
            yield batch

    def _drop_delegate(self) -> None:
        if self._delegate is not None:
            self._delegate.detach()
            self._delegate = None
        self._delegate_src = self._delegate_it = None

    def plan_counters_all_ranks(self) -> SyncCounters:
        """The plan's counters over all ranks (collective with ``planning=by_home``, where each rank
        counts the rows it is home to; otherwise every rank already holds the global figures)."""
        if not self.by_home:
            return self.stats.counters
        parts: List[Any] = [None] * self._W
        dist.all_gather_object(parts, self.stats.counters, group=self._pg)
        total = SyncCounters()
        for c in parts:
            total = total + c
        return total

    def scheduling_report(self) -> Dict[str, Any]:
        """``metrics.json`` ``herald_pipeline.scheduling``: the mode, and for ``auto`` the probe's figures."""
        out: Dict[str, Any] = {"setting": self.config.scheduling, "mode": self.mode}
        if self.probe is not None:
            out.update({k: v for k, v in self.probe.items() if k in ("decided", "on_ms_per_step", "off_ms_per_step")})
        return out

    def plan_step(self) -> None:
        """Stage 4 (lazy sync): plan the head batch's transfers from the window (every rank the same
        plan) and run the pre-read ones; eager sync: count the rows stale-skipping leaves frozen."""
        head = self._queue[0]
        if self.sync == "lazy":
            plan, head.plan = head.plan, None
            if plan is None:  # not made ahead: plan here, on the critical path
                t0 = time.perf_counter()
                plan = self._make_plan(list(self._queue))
                self.stats.scheduler_s += time.perf_counter() - t0
            self.stats.counters = self.stats.counters + plan.counters
            if plan.additive:
                self.stats.stale_reads += plan.stale_reads
                self.stats.max_staleness = max(self.stats.max_staleness, plan.max_staleness)
            self.ebc.begin_plan_step(plan)
            self._flushed = False
        elif self.skip_hook is not None and self.skip_hook.granularity == "row":
            assert head.batch is not None
            self.skip_hook.count_reads(self, torch.unique(self.batch_keys(head.batch.sparse_features)))

    def _prefetch_next(self) -> None:
        """Run-ahead: once this step's pushes are done, take the next batch's plan (made ahead) and start
        its pulls, so they travel while the dense optimizer steps and the next step starts."""
        if self._ahead is None:
            return
        self._collect_ahead()
        if self._queue and self._queue[0].plan is not None:
            self.ebc.prefetch_plan(self._queue[0].plan)

    def _make_plan(self, window: List[HeraldBatchContext]) -> Any:
        """The planner's plan for ``window[0]`` from the window's reads (advances the planner)."""
        t0 = time.perf_counter()
        reads = [ctx.reads for ctx in window]
        if self.skip_hook is not None and self.skip_hook.granularity == "row":
            reads = self.skip_hook.filter_reads(self, reads)
        plan = self.planner.plan_step(reads)
        self.stats.planner_s += time.perf_counter() - t0
        return plan

    def train_step(self, ctx: HeraldBatchContext) -> Any:
        """Stage 5: forward/backward of this rank's share, the plan's reduce/update/pushes, the dense step."""
        assert ctx.batch is not None
        self.stats.steps += 1
        self.stats.moved_samples += ctx.moved
        self._optimizer.zero_grad()
        loss, output = self._model(ctx.batch.to(self._device, non_blocking=True))
        torch.sum(loss).backward()
        if self.sync == "lazy":
            self.ebc.finish_plan_step()
            self._prefetch_next()
        self._optimizer.step()
        return output

    # ------------------------------------------------------------------ checkpoints
    def reset_window(self) -> None:
        """Flush (collective) and forget the window: the next :meth:`progress` refills it from the
        iterator it is given (a checkpoint's data position); the next batch is allocated as the
        ``stats.steps``-th. A run resumed from a checkpoint taken here trains like one never stopped."""
        self._cancel_ahead()
        self._drop_delegate()
        self.flush()
        self._queue.clear()
        self._exhausted = self._started = False
        self._refill = True
        self._alloc_step = self.stats.steps

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the pipeline (JSON-able): its counters; take it after
        :meth:`reset_window`."""
        if self._queue:
            raise RuntimeError("HeraldTrainPipeline.state_dict with batches in the window: call reset_window first")
        from dataclasses import asdict

        return {"stats": asdict(self.stats), "alloc_step": self._alloc_step, "mode": self.mode, "probe": self.probe}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counters (the planner starts from the flushed layout, as saved)."""
        stats = dict(state["stats"])
        stats["counters"] = SyncCounters(**stats["counters"])
        self.stats = SchedulerStats(**stats)
        self._alloc_step = int(state["alloc_step"])
        self._refill = True
        if "mode" in state:
            self.mode, self.probe = state["mode"], state["probe"]
            self._apply_mode()
            self._step_started = None

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

    def detach(self) -> nn.Module:
        """Flush and hand back the model (as ``TrainPipelineSparseDist.detach``); hot rows frozen by
        stale-update skipping are trained again (the herald EBC would otherwise keep them frozen)."""
        self._cancel_ahead()
        self._drop_delegate()
        self.flush()
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
            self._ahead = None
        if self.skip_hook is not None:
            self.skip_hook.detach(self)
        return self._model
