"""Planning by home in compiled code (docs/design.md §3, Herald (b)): :class:`CompiledHomeSplitPlanner` is
:class:`~torchrec_herald.pipeline.home_split.HomeSplitLazyPlanner` with its state and its three stages in
C++ (``torchrec_herald/native/home_split.cpp``: flat hash maps for the caches, the dirty rows and the
copies; per-table LRU buckets; the per-peer messages built and read in one pass). Same messages, same
plans (tests compare the two on random traces); the Python planner stays the readable reference.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from torchrec_herald.pipeline.home_split import Exchange, HomeSplitPlanner, Messages
from torchrec_herald.plans import ExecPlan, FlushPlan, SyncCounters

__all__ = ["CompiledHomeSplitPlanner"]

_COUNTERS = ("reads", "hits", "cache_reads", "cache_hits", "miss_pull", "update_pull", "reduce", "update_push",
             "miss_push")


class CompiledHomeSplitPlanner(HomeSplitPlanner):
    """The owner-route LRU lazy plan by row ownership on rank ``rank``, in compiled code (arguments as
    :class:`~torchrec_herald.pipeline.home_split.HomeSplitLazyPlanner`). Raises
    :class:`~torchrec_herald.native.NativeUnavailable` when the extension is not built."""

    #: ``pipeline.scheduler_impl`` of this planner
    impl = "compiled"

    def __init__(self, locality: object, rank: int, exchange: Optional[Exchange] = None,
                 capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        from torchrec_herald.native import load

        super().__init__(locality, rank, exchange, capacity_fraction, window, capacity_rows)
        lay = self.layout
        self._core = load().HomeSplitCore(self.W, self.rank, lay.table_offsets, lay.blocks, lay.hot_keys,
                                          self.capacity, lay.num_rows)
        self._empty = torch.empty(0, dtype=torch.int64)

    @property
    def step(self) -> int:
        return int(self._core.step())

    def reset(self) -> None:
        """Initial state: every copy valid, caches empty."""
        self._core.reset()

    def state_bytes(self) -> int:
        """Bytes of scheduler state on this rank (hash tables at their allocated size)."""
        return int(self._core.state_bytes())

    def cache_fill(self) -> float:
        """Cached remote rows over the caches' capacity (1.0: every cache is full)."""
        cap = int(self._core.cache_capacity())
        return int(self._core.cache_size()) / cap if cap else 1.0

    def reader_messages(self, window: Sequence[Sequence[torch.Tensor]]) -> Messages:
        """Stage 1 (reader): as :meth:`HomeSplitLazyPlanner.reader_messages`."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        me = self.rank
        use_next = len(window) > 1 and self.window > 1
        nxt = torch.as_tensor(window[1][me], dtype=torch.int64) if use_next else self._empty
        counts, data = self._core.reader(torch.as_tensor(window[0][me], dtype=torch.int64), nxt, use_next)
        return Messages(counts, data)

    def home_replies(self, received: Messages) -> Messages:
        """Stage 2 (home): as :meth:`HomeSplitLazyPlanner.home_replies`."""
        counts, data = self._core.home(received.counts, received.data)
        return Messages(counts, data)

    def assemble(self, replies: Messages) -> ExecPlan:
        """Stage 3: this rank's :class:`ExecPlan`."""
        step = self.step
        pre, pull, pull_miss, reduce, upd, post, miss, now, victims, ctr = self._core.assemble(replies.counts, replies.data)
        W, me = self.W, self.rank
        reads = [self._empty] * W
        reads[me] = now
        evictions = [self._empty] * W
        evictions[me] = victims
        counters = SyncCounters(**dict(zip(_COUNTERS, ctr.tolist())))
        return ExecPlan(step=step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss, reduce=reduce,
                        update_keys=upd, reducer=torch.full_like(upd, me), update_push=post, miss_push=miss,
                        evictions=evictions, counters=counters, partial=True)

    def flush_messages(self) -> Messages:
        """Flush, stage 1 (home): as :meth:`HomeSplitLazyPlanner.flush_messages`."""
        counts, data = self._core.flush_messages()
        return Messages(counts, data)

    def flush_assemble(self, received: Messages) -> FlushPlan:
        """Flush, stage 2: this rank's :class:`FlushPlan`; resets the state."""
        push, pull, dropped_me = self._core.flush_assemble(received.counts, received.data)
        dropped = [self._empty] * self.W
        dropped[self.rank] = dropped_me
        return FlushPlan(push=push, pull=pull, dropped=dropped, partial=True)
