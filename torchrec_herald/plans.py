"""Herald's communication plans (docs/design.md §3, Herald (b); HET's bounded staleness): what one step moves
between the ranks' copies of each row, computed by a :class:`CommPlanner` from the reads of the coming
steps, executed by ``sharding.plan_exec.PlanExecutor``. Every rank computes the same plan, so no ids
travel with the transfers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields
from typing import List, Sequence

import torch

from torchrec_herald.comm import FLOAT_BYTES, INDEX_BYTES
from torchrec_herald.layout import RowLayout

__all__ = ["CommPlanner", "ExecPlan", "FlushPlan", "SyncCounters", "TRANSFER_KINDS", "no_transfers", "scores_from_local_on",
           "sort_transfers"]

#: transfer kinds, each one embedding vector (+ row id)
TRANSFER_KINDS = ("miss_pull", "update_pull", "update_push", "miss_push", "reduce", "deliver")


def no_transfers() -> torch.Tensor:
    """An empty transfer tensor: int64 ``[0, 3]`` of ``(key, src, dst)``."""
    return torch.empty(0, 3, dtype=torch.int64)


def _no_flags() -> torch.Tensor:
    return torch.empty(0, dtype=torch.bool)


def transfer_order(t: torch.Tensor) -> torch.Tensor:
    """Permutation sorting ``(key, src, dst)`` rows by key, then src, then dst."""
    return torch.argsort((t[:, 0] * 65536 + t[:, 1]) * 65536 + t[:, 2])


def sort_transfers(t: torch.Tensor) -> torch.Tensor:
    """``t`` sorted by key, then src, then dst."""
    return t[transfer_order(t)] if t.numel() else no_transfers()


def scores_from_local_on(local: torch.Tensor, sample: torch.Tensor, num_samples: int) -> torch.Tensor:
    """int64 ``[num_samples, W]``: per sample, the lookups ``local`` (bool ``[W, n]``: lookup i is local on
    rank r) counts on each rank; ``sample[i]`` is lookup i's sample."""
    local = local.to(torch.int64)
    return torch.zeros(local.shape[0], num_samples, dtype=torch.int64).index_add_(1, sample, local).T


@dataclass
class SyncCounters:
    """Transfers (embedding vectors) and reads of one step (or a sum of steps).

    ``reads``: (rank, row) reads; ``hits``: reads served without any transfer in the step;
    ``cache_reads`` / ``cache_hits``: the same restricted to remote cold rows (the cache's hit rate).
    """

    miss_pull: int = 0
    update_pull: int = 0
    update_push: int = 0
    miss_push: int = 0
    reduce: int = 0
    deliver: int = 0
    hits: int = 0
    reads: int = 0
    cache_hits: int = 0
    cache_reads: int = 0

    @property
    def vectors(self) -> int:
        """Embedding vectors moved (every transfer kind)."""
        return sum(getattr(self, k) for k in TRANSFER_KINDS)

    @property
    def hit_rate(self) -> float:
        """``hits / reads`` (1.0 with no reads)."""
        return self.hits / self.reads if self.reads else 1.0

    @property
    def cache_hit_rate(self) -> float:
        """``cache_hits / cache_reads`` (1.0 with no remote cold reads)."""
        return self.cache_hits / self.cache_reads if self.cache_reads else 1.0

    def bytes(self, embedding_dim: int) -> int:
        """Wire bytes: ``vectors · (4·D + 4)`` (a vector and its row id)."""
        return self.vectors * (FLOAT_BYTES * int(embedding_dim) + INDEX_BYTES)

    def __add__(self, other: "SyncCounters") -> "SyncCounters":
        return SyncCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass
class ExecPlan:
    """One step's plan over global keys. Each transfer tensor is int64 ``[N, 3]`` of ``(key, src, dst)``
    sorted by key, then src, then dst; in execution order: ``push_before_read`` (only without look-ahead),
    pulls (``miss_pull`` and ``update_pull`` merged in ``pull``, ``pull_miss`` telling which), the reads,
    ``reduce`` + one update per read row at ``reducer``, ``update_push``, ``miss_push``, ``evictions``.

    Bounded staleness (``additive``): a push may *add* the pusher's accumulated update instead of
    replacing the home's copy (the ``*_add`` flags, aligned with the transfer rows; all False, or empty,
    for the exact plan), and the step's staleness figures."""

    step: int
    reads: List[torch.Tensor]  # per rank: sorted unique keys read
    push_before_read: torch.Tensor
    pull: torch.Tensor
    pull_miss: torch.Tensor  # bool [len(pull)]
    reduce: torch.Tensor
    update_keys: torch.Tensor  # sorted keys updated this step: the union of reads (HET, s >= 1: one per read)
    reducer: torch.Tensor  # int64 [len(update_keys)] rank applying each update (HET, s >= 1: the reader)
    update_push: torch.Tensor
    miss_push: torch.Tensor
    evictions: List[torch.Tensor]  # per rank: cached keys dropped after the step
    counters: SyncCounters = field(default_factory=SyncCounters)
    additive: bool = False  # pushes may add (bounded staleness): the executor keeps each copy's base
    push_before_read_add: torch.Tensor = field(default_factory=_no_flags)
    update_push_add: torch.Tensor = field(default_factory=_no_flags)
    miss_push_add: torch.Tensor = field(default_factory=_no_flags)
    stale_reads: int = 0  # reads served by a copy 1..s home versions behind
    max_staleness: int = 0  # the largest lag served in this step
    #: this rank's share only (planning by home): the executor runs every collective even when its
    #: share of one is empty, since another rank's may not be
    partial: bool = False


@dataclass
class FlushPlan:
    """Bring every copy back to the stock layout: dirty rows go home (``push``, adding where
    ``push_add``), then every outdated hot replica pulls the latest version from home (``pull``);
    every cache is dropped (``dropped``)."""

    push: torch.Tensor
    pull: torch.Tensor
    dropped: List[torch.Tensor]
    push_add: torch.Tensor = field(default_factory=_no_flags)
    partial: bool = False  # this rank's share only (see ExecPlan.partial)


class CommPlanner(abc.ABC):
    """Plans each step's transfers from a window of reads, keeping every copy's state; every rank runs it
    on the same reads and gets the same plan.

    Attributes:
        layout: the row space planned over.
        window: ``K >= 1``, steps of look-ahead the planner uses.
        impl: ``python`` (tensor code, the references) or ``compiled`` (``native/``), as
            ``pipeline.scheduler_impl`` names them.
    """

    layout: RowLayout
    window: int
    impl: str = "python"

    @abc.abstractmethod
    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """Plan ``window[0]`` (per rank: the sorted unique keys it reads), the later steps as look-ahead;
        advances the state."""

    @abc.abstractmethod
    def flush(self) -> FlushPlan:
        """The transfers back to the stock layout; resets the state to it."""

    @abc.abstractmethod
    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]``: the input allocator's "local lookup of ``keys[i]`` on rank r"."""

    def local_scores(self, keys: torch.Tensor, sample: torch.Tensor, num_samples: int) -> torch.Tensor:
        """``[num_samples, W]``: lookups of each sample local to each rank (``sample[i]`` the sample of
        ``keys[i]``), from :meth:`local_on` (a planner may build it sparsely)."""
        return scores_from_local_on(self.local_on(keys), sample, num_samples)

    @abc.abstractmethod
    def reset(self) -> None:
        """Initial state: every hot replica and every home copy valid, caches empty."""
