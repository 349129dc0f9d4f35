"""HeraldTrainPipeline: Herald's embedding scheduling as a TorchRec train pipeline (DESIGN §3, Herald).

A look-ahead window of the next K global batches feeds (1) the location-aware input allocator, which
moves samples to the rank that holds their rows, and (2) the lazy, exact communication plan over worker
caches and hot replicas (:class:`~torchrec_herald.pipeline.lazy_sync.TensorLazySyncPlanner`), which the
herald EBC executes (:class:`~torchrec_herald.sharding.plan_exec.PlanExecutor`). Drop-in for
``TrainPipelineSparseDist``: same constructor arguments, ``progress(dataloader_iter)``. Opt-in
approximate modes: HET's bounded staleness (``staleness=s``) and Slipstream's stale-update skipping
(``skip=SkipConfig(...)``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.comm import all_gather_varlen, all_to_all_rows
from torchrec_herald.ops.hot_cold import first_invalid_id
from torchrec_herald.pipeline.input_allocator import greedy_assign
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.pipeline.stale_skip import SkipConfig, StaleSkipper
from torchrec_herald.pipeline.staleness import StalenessPlanner, check_staleness_option
from torchrec_herald.plans import SyncCounters
from torchrec_herald.traffic import traffic_tag

logger = logging.getLogger(__name__)

#: ``pipeline.allocator`` values
ALLOCATORS = ("greedy", "identity")
#: ``pipeline.sync`` values: ``lazy`` = worker caches + the exact plan; ``eager`` = herald's own
#: per-step path (hot rows all-reduced every step, cold rows looked up at their owner)
SYNC_MODES = ("lazy", "eager")
#: ``pipeline.cache`` values executed for real (Belady exists at trace level: ``testing.reference_plans.LazySyncPlanner``)
CACHE_POLICIES = ("lru",)


@dataclass
class _Entry:
    """One global batch in the window: this rank's share after allocation and every rank's reads."""

    batch: Batch
    reads: List[torch.Tensor]
    moved: int = 0


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
    scheduler_s: float = 0.0  # allocation + sample/reads exchange + planning, incl. their collectives
    comm_s: float = 0.0  # of which inside the scheduler's collectives (transfer + waiting for other ranks)
    planner_s: float = 0.0  # of which planning

    def summary(self, step_time_s: float) -> Dict[str, float]:
        n = max(self.steps, 1)
        c = self.counters
        out = {k: getattr(c, k) / n for k in ("miss_pull", "update_pull", "update_push", "miss_push", "reduce")}
        out.update(hit_rate=c.hit_rate, cache_hit_rate=c.cache_hit_rate, vectors_per_step=c.vectors / n,
                   moved_samples_per_step=self.moved_samples / n,
                   local_lookup_share=self.local_lookups / max(self.lookups, 1),
                   scheduler_ms_per_step=1000 * self.scheduler_s / n, planner_ms_per_step=1000 * self.planner_s / n,
                   scheduler_comm_ms_per_step=1000 * self.comm_s / n,
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


def find_herald_ebc(model: nn.Module) -> Any:
    """The one herald-sharded EBC inside ``model`` (a DMP)."""
    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

    found = [m for m in model.modules() if isinstance(m, ShardedHeraldEmbeddingBagCollection)]
    if len(found) != 1:
        raise ValueError(f"HeraldTrainPipeline needs a model with exactly one EmbeddingBagCollection sharded by "
                         f"HeraldEmbeddingBagCollectionSharder (planner=herald); found {len(found)}")
    return found[0]


class HeraldTrainPipeline:
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
        window: ``K``, global batches of look-ahead (default 5).
        allocator: ``greedy`` (location-aware, default) or ``identity`` (samples stay where loaded).
        sync: ``lazy`` (caches + plan, default) or ``eager`` (herald's per-step path, e.g. to measure the
            allocator alone).
        cache: cache eviction policy (``lru``).
        cache_fraction: cache capacity per rank per table as a fraction of the table's rows, in (0, 1].
        move_penalty: local lookups a sample move must gain (``greedy_assign``'s ``move_penalty``).
        staleness: ``None`` (default): the exact plan; an integer ``s >= 0``: HET's bounded staleness
            (:class:`~torchrec_herald.pipeline.staleness.StalenessPlanner`; ``s = 0`` trains exactly).
        skip: ``None`` (default) or a :class:`~torchrec_herald.pipeline.stale_skip.SkipConfig`: Slipstream's
            stale-update skipping of hot rows (needs hot replication).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 execute_all_batches: bool = True, apply_jit: bool = False, *, window: int = 5,
                 allocator: str = "greedy", sync: str = "lazy", cache: str = "lru", cache_fraction: float = 0.05,
                 move_penalty: int = 0, staleness: Optional[int] = None, skip: Optional[SkipConfig] = None) -> None:
        if int(window) < 1:
            raise ValueError(f"pipeline.window must be >= 1, got {window}")
        if allocator not in ALLOCATORS:
            raise ValueError(f"unknown pipeline.allocator {allocator!r}; known: {list(ALLOCATORS)}")
        if sync not in SYNC_MODES:
            raise ValueError(f"unknown pipeline.sync {sync!r}; known: {list(SYNC_MODES)}")
        if cache not in CACHE_POLICIES:
            raise ValueError(f"unknown pipeline.cache {cache!r}; executed policies: {list(CACHE_POLICIES)} "
                             f"(belady is trace-level only: torchrec_herald.testing.reference_plans.LazySyncPlanner)")
        if not 0.0 < float(cache_fraction) <= 1.0:
            raise ValueError(f"pipeline.cache_fraction={cache_fraction}: a cache must hold at least one row and "
                             f"at most all rows of a table; use a fraction in (0, 1]")
        if int(move_penalty) < 0:
            raise ValueError(f"pipeline.move_penalty must be >= 0, got {move_penalty}")
        check_staleness_option(staleness, sync)
        self._model, self._optimizer, self._device = model, optimizer, device
        self.window, self.allocator, self.sync = int(window), allocator, sync
        self.move_penalty = int(move_penalty)
        self._ebc = find_herald_ebc(model)
        ebc = self._ebc
        self._pg = ebc.process_group
        self._W, self._rank = ebc.world_size, ebc.rank
        self.layout = ebc.layout
        self.staleness = None if staleness is None else int(staleness)
        self.planner: TensorLazySyncPlanner = (
            TensorLazySyncPlanner(self.layout, float(cache_fraction), self.window) if staleness is None
            else StalenessPlanner(self.layout, int(staleness), float(cache_fraction), self.window))
        if skip is not None and self.layout.num_hot == 0:
            raise ValueError("pipeline.skip needs hot replication: this plan has no hot rows (use planner=herald "
                             "with a hot-set budget that holds some rows)")
        self.skipper = StaleSkipper(skip, self.layout.num_hot) if skip is not None else None
        self._stale_keys = torch.empty(0, dtype=torch.int64)  # keys of the hot rows classified stale
        self._queue: Deque[_Entry] = deque()
        self._exhausted = False
        self._started = False
        self._flushed = True
        self._alloc_step = 0
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ window
    def _fill(self, it: Iterator[Batch]) -> None:
        while not self._exhausted and len(self._queue) < self.window:
            try:
                raw = next(it)
            except StopIteration:
                self._exhausted = True
                if not self._started:
                    raise ValueError(f"pipeline.window={self.window} is larger than the {len(self._queue)} "
                                     f"batch(es) the data loader has left; lower pipeline.window") from None
                break
            t0 = time.perf_counter()
            self._queue.append(self._prepare(raw))
            self.stats.scheduler_s += time.perf_counter() - t0
        self._started = True

    def _keys(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        kjt = self._ebc.in_feature_order(kjt)
        return self._ebc.global_keys(kjt.values().to(torch.int64), kjt.lengths(), kjt.stride())

    def _prepare(self, raw: Batch) -> _Entry:
        """Validate ids, allocate samples (collective), exchange every rank's read rows (collective).
        Scheduling runs on CPU: a batch the loader put on the device comes back first."""
        if raw.labels.device.type != "cpu":
            raw = raw.to(torch.device("cpu"))
        kjt = self._ebc.in_feature_order(raw.sparse_features)
        B = kjt.stride()
        values, lengths = kjt.values().to(torch.int64), kjt.lengths().to(torch.int64)
        # the id check and global_keys by hand, from one bag index per id (which also gives its sample)
        bag = torch.repeat_interleave(lengths)
        feature = bag // B
        lay = self.layout
        invalid = (values < 0) | (values >= lay.rows_per_feature.index_select(0, feature))
        bad = first_invalid_id(values, lengths, lay.rows_per_feature, B) if bool(invalid.any()) else None
        err = torch.tensor([1 if bad else 0, bad[0] if bad else 0, bad[1] if bad else 0, values.numel()],
                           dtype=torch.int64)
        keys = None if bad else lay.table_offsets[lay.feature_table].index_select(0, feature) + values
        if self.allocator == "greedy" and keys is not None:
            local = self.planner.local_on(keys).to(torch.int64)  # [W, nnz]
            scores = torch.zeros(self._W, B, dtype=torch.int64).index_add_(1, bag % B, local).T
        else:
            scores = torch.zeros(B, self._W, dtype=torch.int64)
        meta = torch.cat([err, _pack_int16(scores)]) if self.allocator == "greedy" else err
        gathered = torch.empty(self._W * meta.numel(), dtype=torch.int64)
        with _CommTimer(self.stats, "herald_schedule_meta"):
            dist.all_gather_into_tensor(gathered, meta, group=self._pg)
        gathered = gathered.view(self._W, -1)
        self._raise_on_bad(gathered[:, :3])
        nnz = int(gathered[:, 3].sum())
        moved = 0
        batch = Batch(dense_features=raw.dense_features, sparse_features=kjt, labels=raw.labels)
        if self.allocator == "greedy":
            all_scores = torch.cat([_unpack_int16(g, B * self._W) for g in gathered[:, 4:]]).view(self._W * B, self._W)
            rank_of = greedy_assign(all_scores, self._alloc_step, "rotate", self.move_penalty)
            self._alloc_step += 1
            moved = int((rank_of != torch.arange(self._W * B) // B).sum())
            all_local = all_scores.gather(1, rank_of[:, None]).sum()
            self.stats.local_lookups += int(all_local)
            self.stats.lookups += nnz
            if moved:
                batch = self._exchange_samples(batch, rank_of[self._rank * B:(self._rank + 1) * B],
                                               (rank_of == self._rank).nonzero().flatten())
                keys = self._keys(batch.sparse_features)
        assert keys is not None
        if self.skipper is not None and self.skipper.config.granularity == "input":
            before = batch.labels.numel()
            batch = self._drop_stale_inputs(batch, self.stats.steps + len(self._queue))
            if batch.labels.numel() != before:
                keys = self._keys(batch.sparse_features)
        reads: List[torch.Tensor] = []
        if self.sync == "lazy":  # = torch.unique(keys); numpy's sort is several times faster than torch's on CPU
            reads = self._exchange_reads(torch.unique_consecutive(torch.from_numpy(np.sort(keys.numpy()))))
        return _Entry(batch=batch, reads=reads, moved=moved)

    def _raise_on_bad(self, errs: torch.Tensor) -> None:
        bad = (errs[:, 0] > 0).nonzero().flatten().tolist()
        if bad:
            raise self._ebc.bad_id_error(bad, int(errs[bad[0], 1]), int(errs[bad[0], 2]))

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

    def _exchange_reads(self, mine: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's sorted unique read keys (int32 on the wire)."""
        return [k.to(torch.int64) for k in self._gather_varlen(mine.to(torch.int32), "herald_schedule_meta")]

    def _gather_varlen(self, mine: torch.Tensor, label: str) -> List[torch.Tensor]:
        """Every rank's ``mine`` (:func:`~torchrec_herald.comm.all_gather_varlen`), timed as scheduler comm."""
        with _CommTimer(self.stats, label):
            return all_gather_varlen(mine, self._pg, label)

    # ------------------------------------------------------------------ training
    def progress(self, dataloader_iter: Iterator[Batch]) -> Any:
        """Train one global batch; returns the model's output (as ``TrainPipelineSparseDist`` does).

        Raises:
            StopIteration: the loader and the window are empty (copies flushed first).
            ValueError: the first window cannot be filled (``window`` > batches left), bad ids (every rank).
        """
        self._fill(dataloader_iter)
        if not self._queue:
            self.flush()
            self._exhausted = self._started = False  # the next progress() may start a new epoch's iterator
            raise StopIteration
        if self.skipper is not None:
            self._skip_phase(self.stats.steps)
        entry = self._queue[0]
        lazy = self.sync == "lazy"
        if lazy:
            t0 = time.perf_counter()
            reads = [e.reads for e in self._queue]
            if self.skipper is not None and self.skipper.config.granularity == "row":
                reads = self._without_frozen(reads)
            plan = self.planner.plan_step(reads)
            dt = time.perf_counter() - t0
            self.stats.planner_s += dt
            self.stats.scheduler_s += dt
            self.stats.counters = self.stats.counters + plan.counters
            if plan.additive:
                self.stats.stale_reads += plan.stale_reads
                self.stats.max_staleness = max(self.stats.max_staleness, plan.max_staleness)
            self._ebc.begin_plan_step(plan)
            self._flushed = False
        elif self.skipper is not None and self.skipper.config.granularity == "row":  # eager: count frozen reads
            rows = torch.unique(self._keys(entry.batch.sparse_features))
            self.stats.candidate_updates += rows.numel()
            if self._stale_keys.numel():
                self.stats.skipped_updates += int(torch.isin(rows, self._stale_keys).sum())
        self._queue.popleft()
        self.stats.steps += 1
        self.stats.moved_samples += entry.moved
        self._optimizer.zero_grad()
        loss, output = self._model(entry.batch.to(self._device, non_blocking=True))
        torch.sum(loss).backward()
        if lazy:
            self._ebc.finish_plan_step()
        self._optimizer.step()
        return output

    # ------------------------------------------------------------------ stale-update skipping
    def _skip_phase(self, step: int) -> None:
        """Snapshots at the ends of each measuring window (after a flush, so every rank sees the same
        hot rows), the threshold search at its end, and the (un)freezing of stale rows."""
        assert self.skipper is not None
        phase = self.skipper.phase(step)
        if phase not in ("snapshot_a", "snapshot_b"):
            return
        self.flush()
        second = phase == "snapshot_b"
        self.skipper.take_snapshot(self._ebc.hot_values(), second=second)
        if second:
            self.skipper.set_threshold(step, self._sampled_scores())
        stale = self.skipper.stale if second else None
        self._stale_keys = self.layout.hot_keys[stale] if stale is not None else torch.empty(0, dtype=torch.int64)
        if self.skipper.config.granularity == "row":
            if self.sync == "eager":
                self._ebc.set_frozen_hot(stale)
            self._ebc.set_frozen_keys(self._stale_keys)

    def _movement_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Movement (max |Δ| over the last measuring window) of the rows ``keys``; ``inf`` if not hot."""
        assert self.skipper is not None and self.skipper.movement is not None
        hot_keys = self.layout.hot_keys
        pos = torch.searchsorted(hot_keys, keys).clamp(max=max(hot_keys.numel() - 1, 0))
        hot = hot_keys[pos] == keys if hot_keys.numel() else torch.zeros_like(keys, dtype=torch.bool)
        out = torch.full((keys.numel(),), float("inf"))
        out[hot] = self.skipper.movement[pos[hot]]
        return out

    def _sampled_scores(self) -> torch.Tensor:
        """Every rank's scores (:func:`sample_scores`) on the window's upcoming batches, all-gathered so
        every rank searches the same threshold."""
        assert self.skipper is not None
        local = []
        for e in self._queue:
            kjt = e.batch.sparse_features
            B, F = kjt.stride(), len(kjt.keys())
            lengths = kjt.lengths().to(torch.int64)
            mv = self._movement_of(self._keys(kjt))
            if self.skipper.config.granularity == "row":
                local.append(mv)
            else:
                sample = torch.repeat_interleave(torch.arange(F * B) % B, lengths)
                worst = torch.full((B,), float("-inf")).scatter_reduce(0, sample, mv, "amax", include_self=True)
                worst[torch.bincount(sample, minlength=B) == 0] = float("inf")  # no lookups: never skipped
                local.append(worst)
        mine = torch.cat(local).float() if local else torch.empty(0)
        return torch.cat(self._gather_varlen(mine, "herald_skip_meta"))

    def _without_frozen(self, reads: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """Row granularity: frozen rows are read but never updated, so the plan leaves them out (their
        replicas were synchronised by the snapshot's flush and stay so); counts the skipped updates."""
        frozen = self._stale_keys
        out = []
        for k, step_reads in enumerate(reads):
            kept = []
            for r in step_reads:
                f = torch.isin(r, frozen) if frozen.numel() else torch.zeros_like(r, dtype=torch.bool)
                kept.append(r[~f])
                if k == 0:
                    self.stats.candidate_updates += r.numel()
                    self.stats.skipped_updates += int(f.sum())
            out.append(kept)
        return out

    def _drop_stale_inputs(self, batch: Batch, train_step: int) -> Batch:
        """Input granularity: drop the samples all of whose lookups are stale hot rows (at least one
        sample stays on every rank); counts skipped inputs and their lookups."""
        kjt = batch.sparse_features
        B, F = kjt.stride(), len(kjt.keys())
        lengths = kjt.lengths().to(torch.int64)
        self.stats.candidate_updates += int(lengths.sum())
        if self.skipper is None or self.skipper.phase(train_step) != "skip" or not self._stale_keys.numel():
            return batch
        sample = torch.repeat_interleave(torch.arange(F * B) % B, lengths)
        stale = torch.isin(self._keys(kjt), self._stale_keys)
        n = torch.bincount(sample, minlength=B)
        drop = (torch.bincount(sample, weights=stale.double(), minlength=B) == n) & (n > 0)
        if bool(drop.all()):
            drop[0] = False
        if not bool(drop.any()):
            return batch
        keep = ~drop
        self.stats.skipped_inputs += int(drop.sum())
        self.stats.skipped_updates += int(n[drop].sum())
        value_kept = keep[sample]
        new_lengths = lengths.view(F, B)[:, keep].flatten()
        new_kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[value_kept],
                                    lengths=new_lengths.to(kjt.lengths().dtype))
        return Batch(dense_features=batch.dense_features[keep], sparse_features=new_kjt, labels=batch.labels[keep])

    def flush(self) -> None:
        """Push every dirty row home, refresh outdated hot replicas, drop the caches (collective): the
        model is then in herald's stock layout (for eval, ``state_dict``, a stock pipeline)."""
        if self._flushed:
            return
        self._ebc.flush_plan(self.planner.flush())
        self._flushed = True

    def detach(self) -> nn.Module:
        """Flush and hand back the model (as ``TrainPipelineSparseDist.detach``); hot rows frozen by
        stale-update skipping are trained again (the herald EBC would otherwise keep them frozen)."""
        self.flush()
        if self.skipper is not None:
            self._stale_keys = torch.empty(0, dtype=torch.int64)
            self._ebc.set_frozen_hot(None)
            self._ebc.set_frozen_keys(self._stale_keys)
        return self._model
