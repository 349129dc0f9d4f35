"""The global lazy plans in compiled code (docs/design.md §3, Herald (b); HET's bounded staleness):
:class:`CompiledLazySyncPlanner` and :class:`CompiledStalenessPlanner` are
:class:`~torchrec_herald.pipeline.lazy_sync.TensorLazySyncPlanner` and
:class:`~torchrec_herald.pipeline.staleness.StalenessPlanner` with their state and their step in C++
(``torchrec_herald/native/global_plan.cpp``: flat hash maps for the rows and the copies, per-(rank, table)
LRU buckets, one pass over the step's (key, rank) reads, the GIL released). Same plans, flushes and
allocator scores (tests compare them on random traces); the tensor planners stay the readable reference.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

import torch

from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.pipeline.staleness import StalenessPlanner, checked_staleness
from torchrec_herald.plans import ExecPlan, FlushPlan, SyncCounters

__all__ = ["CompiledLazySyncPlanner", "CompiledStalenessPlanner"]

_COUNTERS = ("reads", "hits", "cache_reads", "cache_hits", "miss_pull", "update_pull", "reduce", "update_push",
             "miss_push")


def _keys(window_step: Sequence[Any]) -> List[torch.Tensor]:
    return [torch.as_tensor(k, dtype=torch.int64) for k in window_step]


def _per_rank(keys: torch.Tensor, counts: torch.Tensor) -> List[torch.Tensor]:
    return list(keys.split(counts.tolist()))


class _CompiledGlobalPlan:
    """What both compiled global planners share: the layout arguments, the state held in ``_core``."""

    #: ``pipeline.scheduler_impl`` of this planner
    impl = "compiled"
    _core: Any

    def _setup(self, locality: Any, capacity_fraction: float, window: int,
               capacity_rows: Optional[Mapping[str, int]]) -> List[Any]:
        """The layout as the tensor planner keeps it; returns the compiled core's arguments."""
        TensorLazySyncPlanner._set_layout(self, locality, capacity_fraction, window, capacity_rows)  # type: ignore[arg-type]
        lay = self.layout
        return [self.W, lay.table_offsets, lay.blocks, lay.hot_keys, self.capacity, lay.num_rows, self.window]

    @property
    def step(self) -> int:  # type: ignore[override]
        return int(self._core.step())

    def reset(self) -> None:
        """Initial state: every copy valid, caches empty."""
        self._core.reset()

    def state_bytes(self) -> int:
        """Bytes of scheduler state (hash tables at their allocated size, LRU buckets, hot replica state)."""
        return int(self._core.state_bytes())

    def cached_rows(self) -> List[torch.Tensor]:
        """Per rank, the keys it caches (sorted)."""
        return _per_rank(*self._core.cached_rows())

    def local_scores(self, keys: torch.Tensor, sample: torch.Tensor, num_samples: int) -> torch.Tensor:
        """int32 ``[num_samples, W]``: lookups of each sample local to each rank (as the tensor planner's)."""
        return self._core.local_scores(keys, sample, int(num_samples))

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, *keys.shape]``: what the input allocator counts as a local lookup of each key on each rank."""
        keys = torch.as_tensor(keys, dtype=torch.int64)
        k = keys.reshape(-1)
        on = self._core.local_scores(k, torch.arange(k.numel()), k.numel()) > 0
        return on.T.contiguous().view(self.W, *keys.shape)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(f"{type(self).__name__} holds its state in compiled code and is not copied; "
                        "replay or inspect the tensor planner (pipeline.scheduler_impl=python)")


class CompiledLazySyncPlanner(_CompiledGlobalPlan, TensorLazySyncPlanner):
    """The exact owner-route LRU lazy plan of :class:`TensorLazySyncPlanner` in compiled code (same
    arguments). Raises :class:`~torchrec_herald.native.NativeUnavailable` when the extension is not built."""

    def __init__(self, locality: Any, capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        from torchrec_herald.native import load

        self._core = load().GlobalExactCore(*self._setup(locality, capacity_fraction, window, capacity_rows))

    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """As :meth:`TensorLazySyncPlanner.plan_step`."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        step = self.step
        reads = _keys(window[0])
        use_next = len(window) > 1
        nxt = _keys(window[1]) if use_next else []
        (pre, pull, pull_miss, reduce, upd, reducer, post, miss, evicted, per_rank,
         ctr) = self._core.plan_step(reads, nxt, use_next)
        return ExecPlan(step=step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss, reduce=reduce,
                        update_keys=upd, reducer=reducer, update_push=post, miss_push=miss,
                        evictions=_per_rank(evicted, per_rank),
                        counters=SyncCounters(**dict(zip(_COUNTERS, ctr.tolist()))))

    def flush(self) -> FlushPlan:
        """As :meth:`TensorLazySyncPlanner.flush`: the transfers back to the stock layout; resets."""
        push, pull, cached, per_rank = self._core.flush()
        return FlushPlan(push=push, pull=pull, dropped=_per_rank(cached, per_rank))


class CompiledStalenessPlanner(_CompiledGlobalPlan, StalenessPlanner):
    """HET's bounded-staleness plan of :class:`StalenessPlanner` in compiled code (same arguments)."""

    def __init__(self, locality: Any, staleness: int, capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        from torchrec_herald.native import load

        self.staleness = checked_staleness(staleness)
        args = self._setup(locality, capacity_fraction, window, capacity_rows)
        self._core = load().GlobalStalenessCore(*args, self.staleness)

    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """As :meth:`StalenessPlanner.plan_step`."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        step = self.step
        reads = _keys(window[0])
        (pre, pre_add, pull, pull_miss, reduce, upd, reducer, post, post_add, miss, miss_add, evicted, per_rank,
         ctr, stale) = self._core.plan_step(reads)
        stale_reads, max_staleness = stale.tolist()
        return ExecPlan(step=step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss, reduce=reduce,
                        update_keys=upd, reducer=reducer, update_push=post, miss_push=miss,
                        evictions=_per_rank(evicted, per_rank),
                        counters=SyncCounters(**dict(zip(_COUNTERS, ctr.tolist()))), additive=True,
                        push_before_read_add=pre_add, update_push_add=post_add, miss_push_add=miss_add,
                        stale_reads=int(stale_reads), max_staleness=int(max_staleness))

    def flush(self) -> FlushPlan:
        """As :meth:`StalenessPlanner.flush`: every pending update home, lagging hot replicas refreshed; resets."""
        push, add, pull, cached, per_rank = self._core.flush()
        return FlushPlan(push=push, pull=pull, dropped=_per_rank(cached, per_rank), push_add=add)
