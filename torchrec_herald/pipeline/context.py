"""What the herald pipeline's stages share: a batch's context in the window (a TorchRec
``TrainPipelineContext``), the scheduler's counters, and the pipeline's environment (the herald EBC, its
row layout and process group, the planner, the allocator, the counters)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.comm import all_gather_varlen
from torchrec_herald.native import load_if_built
from torchrec_herald.plans import CommPlanner, SyncCounters
from torchrec_herald.traffic import traffic_tag

#: the name prefix of the run-ahead worker thread (``pipeline/run_ahead.py``)
RUN_AHEAD_THREAD = "herald-ahead"

__all__ = ["RUN_AHEAD_THREAD", "CommTimer", "HeraldBatchContext", "SchedulerStats", "SchedulingEnv", "find_herald_ebc",
           "concat_samples", "pack_int16", "select_samples", "unpack_int16"]


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
    train_step: int = 0  # the training step at which this batch trains (fixed when it enters the window)


@dataclass
class SchedulerStats:
    """Per-run totals of the scheduler (``metrics.json`` ``herald_pipeline``)."""

    steps: int = 0
    counters: SyncCounters = field(default_factory=SyncCounters)
    moved_samples: int = 0
    local_lookups: int = 0
    lookups: int = 0
    skipped_inputs: int = 0  # stale-update skipping, input granularity: samples not trained
    inputs_read: int = 0  # input skipping that refills its batches: the data's samples read (all ranks)
    skipped_updates: int = 0  # (sample lookups | row reads) whose update was skipped
    candidate_updates: int = 0  # the same, all of them (while a classification was active or not)
    stale_reads: int = 0  # bounded staleness: reads served by a copy 1..s versions behind
    max_staleness: int = 0  # the largest lag served
    scheduler_s: float = 0.0  # on the critical path: allocation + sample/reads exchange + planning, incl. their
    # collectives, and waiting for the run-ahead thread
    ahead_s: float = 0.0  # run-ahead thread: scheduling done while steps trained (off the critical path)
    wait_ahead_s: float = 0.0  # of scheduler_s: the step waiting for the run-ahead thread
    comm_s: float = 0.0  # of which inside the scheduler's collectives (transfer + waiting for other ranks)
    comm_ahead_s: float = 0.0  # of ahead_s: inside the scheduler's collectives in the run-ahead thread
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

    def summary(self, step_time_s: float) -> dict:
        n = max(self.steps, 1)
        c = self.counters
        out = {k: getattr(c, k) / n for k in ("miss_pull", "update_pull", "update_push", "miss_push", "reduce")}
        out.update(hit_rate=c.hit_rate, cache_hit_rate=c.cache_hit_rate, plan_transfers_per_step_all_ranks=c.vectors / n,
                   moved_samples_per_step=self.moved_samples / n,
                   local_lookup_share=self.local_lookups / max(self.lookups, 1),
                   scheduler_ms_per_step=1000 * self.scheduler_s / n, planner_ms_per_step=1000 * self.planner_s / n,
                   scheduler_comm_ms_per_step=1000 * self.comm_s / n,
                   scheduler_comm_ahead_ms_per_step=1000 * self.comm_ahead_s / n,
                   scheduler_overlapped_ms_per_step=1000 * self.ahead_s / n,
                   scheduler_wait_ahead_ms_per_step=1000 * self.wait_ahead_s / n,
                   stale_reads_per_step=self.stale_reads / n, stale_read_share=self.stale_reads / max(c.reads, 1),
                   max_staleness=self.max_staleness,
                   scheduler_compute_ms_per_step=1000 * (self.scheduler_s - self.comm_s) / n,
                   scheduler_share_of_step=(self.scheduler_s / n) / step_time_s if step_time_s > 0 else 0.0,
                   scheduler_compute_share_of_step=((self.scheduler_s - self.comm_s) / n) / step_time_s
                   if step_time_s > 0 else 0.0)
        return out


class CommTimer:
    """Adds the wall time of its block to ``stats.comm_s`` (and tags the collectives for TrafficMeter); in
    the run-ahead thread to ``stats.comm_ahead_s`` instead (that time is off the step's critical path)."""

    def __init__(self, stats: SchedulerStats, label: str) -> None:
        self.stats, self.tag = stats, traffic_tag(label)

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.tag.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.tag.__exit__(*exc)
        if threading.current_thread().name.startswith(RUN_AHEAD_THREAD):
            self.stats.comm_ahead_s += time.perf_counter() - self.t0
        else:
            self.stats.comm_s += time.perf_counter() - self.t0


@dataclass
class SchedulingEnv:
    """What the stages and the scheduling strategy of one pipeline share.

    Attributes:
        ebc: the herald-sharded EBC (``ShardedHeraldEmbeddingBagCollection``).
        pg, world, rank: its process group, world size and rank.
        sched_pg: a process group of the scheduler's own (gloo), where its strategy has collectives of its
            own: their tensors are the host's, and run ahead in a thread they must never interleave with
            training's; None: ``pg``.
        stats: the scheduler's counters (replaced when a checkpoint is loaded).
        planner: the communication planner (a :class:`~torchrec_herald.plans.CommPlanner`).
        allocator: the input allocator in use (the configured one while scheduling is on, identity off).
        alloc_step: the allocator's step (its tie rotation), the index of the next global batch allocated.
        move_penalty: the move penalty the last per-rank batch was priced at (None: none priced yet;
            whole global batches price nothing: a move sends no bytes there).
    """

    ebc: Any
    pg: Optional[dist.ProcessGroup]
    world: int
    rank: int
    stats: SchedulerStats
    planner: CommPlanner
    allocator: Any
    alloc_step: int = 0
    move_penalty: Optional[int] = None
    sched_pg: Optional[dist.ProcessGroup] = None

    @property
    def layout(self) -> Any:
        return self.ebc.layout

    @property
    def scheduling_group(self) -> Optional[dist.ProcessGroup]:
        """The group the scheduler's collectives run on: its own, or the training's."""
        return self.sched_pg if self.sched_pg is not None else self.pg

    def batch_keys(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """Global row key of every id of ``kjt``."""
        kjt = self.ebc.in_feature_order(kjt)
        return self.ebc.global_keys(kjt.values().to(torch.int64), kjt.lengths(), kjt.stride())

    def gather_varlen(self, mine: torch.Tensor, label: str) -> List[torch.Tensor]:
        """Every rank's ``mine`` (:func:`~torchrec_herald.comm.all_gather_varlen`), timed as scheduler comm."""
        with CommTimer(self.stats, label):
            return all_gather_varlen(mine, self.scheduling_group, label)

    def raise_on_bad(self, errs: torch.Tensor) -> None:
        """Raise the first rank's bad-id error (``errs``: per rank ``(flag, feature, id)``), every rank alike."""
        bad = (errs[:, 0] > 0).nonzero().flatten().tolist()
        if bad:
            raise on_every_rank(self.ebc.bad_id_error(bad, int(errs[bad[0], 1]), int(errs[bad[0], 2])))


#: set on an error that every rank raises at the same batch (a bad id found by a collective, or in a global
#: batch every rank reads): a step that meets it from the run-ahead thread may end first (``train_pipeline``)
EVERY_RANK = "herald_raised_on_every_rank"


def on_every_rank(error: BaseException) -> BaseException:
    """``error``, marked as raised by every rank alike at the same batch (:data:`EVERY_RANK`)."""
    setattr(error, EVERY_RANK, True)
    return error


def pack_int16(scores: torch.Tensor) -> torch.Tensor:
    """int64 view of ``scores`` as int16 (clamped), zero-padded to a multiple of 4: 2 bytes per score."""
    flat = scores.flatten().clamp(max=32767).to(torch.int16)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)])
    return flat.view(torch.int64)


def unpack_int16(packed: torch.Tensor, n: int) -> torch.Tensor:
    return packed.contiguous().view(torch.int16)[:n].to(torch.int64)


def concat_samples(batches: List[Batch]) -> Batch:
    """The samples of ``batches`` (the same features, in the same order), one after the other."""
    if len(batches) == 1:
        return batches[0]
    kjts = [b.sparse_features for b in batches]
    F = len(kjts[0].keys())
    lengths = torch.cat([k.lengths().view(F, -1) for k in kjts], 1)
    parts = [k.values().split(k.length_per_key()) for k in kjts]  # per batch, per feature
    values = torch.cat([p[f] for f in range(F) for p in parts])
    return Batch(dense_features=torch.cat([b.dense_features for b in batches]),
                 sparse_features=KeyedJaggedTensor(keys=kjts[0].keys(), values=values, lengths=lengths.reshape(-1)),
                 labels=torch.cat([b.labels for b in batches]))


def select_samples(batch: Batch, index: torch.Tensor) -> Batch:
    """The samples ``index`` of ``batch`` (in that order): dense rows, labels and every feature's bags.
    By hand: fbgemm's ``keyed_jagged_index_select_dim1`` has no CPU kernel in fbgemm-gpu-cpu 1.8; one
    compiled pass (``native/batch_keys.cpp``) where the module is built and the batch is on CPU."""
    kjt = batch.sparse_features
    G, F = kjt.stride(), len(kjt.keys())
    native = load_if_built() if kjt.values().device.type == "cpu" else None
    if native is not None:
        lengths, values = native.select_bags(kjt.lengths(), kjt.values(), index, G)
    else:
        lengths = kjt.lengths().view(F, G).index_select(1, index).reshape(-1)
        starts = kjt.offsets()[:-1].view(F, G).index_select(1, index).reshape(-1)
        ends = torch.cumsum(lengths, 0)
        pos = torch.repeat_interleave(starts - (ends - lengths), lengths) + torch.arange(
            int(ends[-1]) if ends.numel() else 0)
        values = kjt.values().index_select(0, pos)
    return Batch(dense_features=batch.dense_features.index_select(0, index),
                 sparse_features=KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths),
                 labels=batch.labels.index_select(0, index))


def herald_ebcs(model: nn.Module) -> List[Any]:
    """The herald-sharded EBCs inside ``model`` (a DMP)."""
    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

    return [m for m in model.modules() if isinstance(m, ShardedHeraldEmbeddingBagCollection)]


def find_herald_ebc(model: nn.Module) -> Any:
    """The one herald-sharded EBC inside ``model`` (a DMP)."""
    found = herald_ebcs(model)
    if len(found) != 1:
        raise ValueError(f"HeraldTrainPipeline needs a model with exactly one EmbeddingBagCollection sharded by "
                         f"HeraldEmbeddingBagCollectionSharder (planner=herald); found {len(found)}")
    return found[0]


def stock_tables_beside(model: nn.Module) -> List[str]:
    """The tables a mixed EBC inside ``model`` keeps stock-sharded beside herald's (none: every table is herald's)."""
    from torchrec_herald.sharding.mixed import ShardedMixedEmbeddingBagCollection

    return [t for m in model.modules() if isinstance(m, ShardedMixedEmbeddingBagCollection) for t in m.stock_tables]
