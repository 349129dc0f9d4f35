"""Hot-row selection (P²RES two-fold parallelism): which rows of each table to replicate on every rank.

Interface in the style of ``torchrec/distributed/planner/types.py``: a :class:`HotSetSelector` turns
:class:`~torchrec_herald.planner.stats.AccessStats` into one :class:`HotSetChoice` per table; the
planner only sees that interface, so selectors are swappable. :class:`CostModelHotSetSelector` is the
cost model, :class:`TopFractionHotSetSelector` the fixed top-k % baseline.

Cost model: the wire format of herald's sharding, bytes summed over all ``W`` ranks per training step
(local batch ``B``, global batch ``G = W·B``, embedding dim ``D``, 4-byte floats):

* cold row ``x`` (row-wise sharded, owner ``x // ceil(n/W)``): each remote lookup (probability
  ``(W−1)/W``) ships a 4 B int32 owner-local id + a 4 B int32 sub-bag length forward, a ``4D`` B partial
  pooled vector back and its ``4D`` B gradient again in backward: ``c_cold = 8 + 8D`` B. Expected cold
  cost of ``x``: ``λ_x·(W−1)/W·c_cold`` with ``λ_x`` its expected lookups per global step. (Exact for
  one-id bags; for multi-id bags it prices every id as its own sub-bag, an upper bound.)
* hot rows (a replica on every rank, looked up locally), gradient sync per step, per table either
  ``"dense"`` — ring all-reduce of the ``h``-row hot gradient buffer: ``2·(W−1)·h·4D`` — or ``"sparse"`` —
  every rank sends the hot rows its local batch touched (4 B row index + ``4D`` B gradient) to each of
  the ``W−1`` others: ``W·(W−1)·(4+4D)·Σ_x P_x`` with ``P_x = 1 − (1 − p_x)^B``, ``p_x`` the per-sample
  lookup probability (``λ_x / G`` for one-id features).
* memory of a hot row, on every rank: ``4D`` (weights) + 4 (row-wise Adagrad state) bytes.
* stock references: TABLE_WISE ships every remote (sample, feature)'s ids (8 B each) + length (4 B) and
  its pooled vector and gradient: ``(W−1)/W·(8·L + G·F·(4 + 8D))`` (``L`` lookups per step, ``F``
  features; ``G·(W−1)/W·(12 + 8D)`` for one one-id feature); ROW_WISE reduce-scatters the whole global
  batch forward and all-gathers its gradients back (``2·(W−1)·G·F·4D``) plus ids ``(W−1)/W·8·L`` and
  lengths ``(W−1)·G·F·4``.

All math is float64 and vectorised over rows; the same functions produce the planner's printout. The
selectors work on each table's sampled rows (rows never seen in the stats have ``λ = P = 0``: the cost
model never replicates them and they add zero to every total), ~2 % of the rows at full Criteo Kaggle size.
"""

from __future__ import annotations

import abc
import logging
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_herald.comm import (  # noqa: F401  (re-exported: the cost model speaks in these)
    FLOAT_BYTES,
    INDEX_BYTES,
    OPTIMIZER_STATE_BYTES,
    STOCK_ID_BYTES,
    STOCK_LENGTH_BYTES,
    ring_allreduce_bytes,
    row_with_state_bytes,
)
from torchrec_herald.planner.pricing import ByteCount, Pricing
from torchrec_herald.planner.stats import AccessStats

logger = logging.getLogger(__name__)

__all__ = [
    "FLOAT_BYTES", "INDEX_BYTES", "STOCK_ID_BYTES", "SYNC_MODES",
    "TableTraffic", "HotSetChoice", "HotSetSelector", "CostModelHotSetSelector", "TopFractionHotSetSelector",
    "remote_fraction", "cold_lookup_bytes", "hot_row_bytes", "touch_probability", "replication_saving",
    "dense_sync_row_cost", "sparse_sync_row_cost", "dense_break_even_lookups",
    "expected_cold_bytes", "cold_bytes_breakdown", "dense_sync_bytes", "sparse_sync_bytes",
    "stock_table_wise_bytes", "stock_row_wise_bytes", "table_traffic", "total_traffic", "format_traffic_report",
]

#: hot-row gradient sync modes ("none": no hot rows)
SYNC_MODES = ("dense", "sparse", "none")

Number = Union[float, int, torch.Tensor]


def _total(x: Number) -> float:
    """Sum of a tensor (float64) or the number itself."""
    return float(x.to(torch.float64).sum()) if isinstance(x, torch.Tensor) else float(x)


# ---------------------------------------------------------------------- per-row terms


def remote_fraction(world_size: int) -> float:
    """Probability that a lookup's owner is another rank, ``(W−1)/W``."""
    return (world_size - 1) / world_size


def cold_lookup_bytes(embedding_dim: int) -> int:
    """``c_cold = 8 + 8D``: bytes of one remote cold lookup (id + length, pooled vector, its gradient)."""
    return 2 * INDEX_BYTES + 2 * embedding_dim * FLOAT_BYTES


def hot_row_bytes(embedding_dim: int) -> int:
    """Memory of one replicated row on every rank: ``4D`` weights + 4 B row-wise Adagrad state."""
    return row_with_state_bytes(embedding_dim)


def touch_probability(sample_prob: torch.Tensor, local_batch_size: int) -> torch.Tensor:
    """``P_x = 1 − (1 − p_x)^B``: probability that a rank's local batch touches row ``x`` (float64)."""
    p = sample_prob.to(torch.float64).clamp(0.0, 1.0)
    return -torch.expm1(local_batch_size * torch.log1p(-p))


def replication_saving(lookups_per_step: torch.Tensor, world_size: int, embedding_dim: int) -> torch.Tensor:
    """Per row, the expected cold bytes a replica saves: ``λ_x·(W−1)/W·(8 + 8D)`` (float64)."""
    return lookups_per_step.to(torch.float64) * (remote_fraction(world_size) * cold_lookup_bytes(embedding_dim))


def dense_sync_row_cost(world_size: int, embedding_dim: int) -> float:
    """A hot row's share of the dense ring all-reduce: ``2·(W−1)·4D`` bytes."""
    return ring_allreduce_bytes(embedding_dim * FLOAT_BYTES, world_size) * world_size  # (every rank's)


def sparse_sync_row_cost(touch_prob: torch.Tensor, world_size: int, embedding_dim: int) -> torch.Tensor:
    """A hot row's expected sparse-sync bytes: ``W·(W−1)·(4 + 4D)·P_x`` (float64)."""
    per_send = world_size * (world_size - 1) * (INDEX_BYTES + embedding_dim * FLOAT_BYTES)
    return touch_prob.to(torch.float64) * float(per_send)


def dense_break_even_lookups(world_size: int, embedding_dim: int) -> float:
    """``λ*`` above which replicating a row with dense sync pays:
    ``2·(W−1)·4D / ((W−1)/W·(8 + 8D))`` (``inf`` for one rank)."""
    if world_size <= 1:
        return math.inf
    return dense_sync_row_cost(world_size, embedding_dim) / (
        remote_fraction(world_size) * cold_lookup_bytes(embedding_dim))


# ---------------------------------------------------------------------- per-table totals


def expected_cold_bytes(lookups_per_step: Number, world_size: int, embedding_dim: int) -> float:
    """Expected cold-path bytes per step of rows with ``Σλ`` = ``lookups_per_step`` (tensor: summed):
    ``Σλ·(W−1)/W·(8 + 8D)``."""
    return _total(lookups_per_step) * remote_fraction(world_size) * cold_lookup_bytes(embedding_dim)


def cold_bytes_breakdown(lookups_per_step: Number, world_size: int, embedding_dim: int
                         ) -> Tuple[float, float, float]:
    """``(ids + lengths, pooled vectors, gradients)`` of :func:`expected_cold_bytes`."""
    remote = _total(lookups_per_step) * remote_fraction(world_size)
    vec = remote * embedding_dim * FLOAT_BYTES
    return remote * 2 * INDEX_BYTES, vec, vec


def dense_sync_bytes(num_hot: int, world_size: int, embedding_dim: int) -> float:
    """Ring all-reduce of an ``h``-row hot gradient buffer: ``2·(W−1)·h·4D`` bytes (all ranks)."""
    return float(num_hot) * dense_sync_row_cost(world_size, embedding_dim)


def sparse_sync_bytes(touch_prob: Number, world_size: int, embedding_dim: int) -> float:
    """Sparse exchange of touched hot rows: ``W·(W−1)·(4 + 4D)·ΣP_x`` (``touch_prob``: tensor summed)."""
    return _total(touch_prob) * world_size * (world_size - 1) * (INDEX_BYTES + embedding_dim * FLOAT_BYTES)


def stock_table_wise_bytes(lookups_per_step: Number, global_batch_size: int, world_size: int,
                           embedding_dim: int, num_features: int = 1) -> float:
    """Stock TABLE_WISE bytes per step (all ranks) of one table:
    ``(W−1)/W·(8·L + G·F·(4 + 8D))`` — remote samples' ids and lengths, pooled vectors, gradients."""
    per_bag = STOCK_LENGTH_BYTES + 2 * embedding_dim * FLOAT_BYTES
    return remote_fraction(world_size) * (STOCK_ID_BYTES * _total(lookups_per_step)
                                          + global_batch_size * num_features * per_bag)


def stock_row_wise_bytes(lookups_per_step: Number, global_batch_size: int, world_size: int,
                         embedding_dim: int, num_features: int = 1) -> float:
    """Stock ROW_WISE bytes per step (all ranks) of one table: reduce-scatter of the global batch's
    partial pooled vectors ``(W−1)·G·F·4D`` + all-gather of their gradients (same) + ids
    ``(W−1)/W·8·L`` + lengths ``(W−1)·G·F·4``."""
    vectors = 2.0 * (world_size - 1) * global_batch_size * num_features * embedding_dim * FLOAT_BYTES
    ids = remote_fraction(world_size) * STOCK_ID_BYTES * _total(lookups_per_step)
    lengths = float((world_size - 1) * global_batch_size * num_features * STOCK_LENGTH_BYTES)
    return vectors + ids + lengths


@dataclass
class TableTraffic:
    """Expected traffic of one table (or a sum of tables) per training step, bytes summed over ranks.

    Attributes:
        lookups: expected lookups per global step.
        hot_lookups: of which hit replicated rows (served locally).
        cold_remote_lookups: expected cold lookups whose owner is another rank.
        stock_table_wise / stock_row_wise: the same table sharded by stock TorchRec.
        herald_cold_ids / herald_cold_pooled / herald_cold_grads: herald's cold path (ids + sub-bag
            lengths forward, partial pooled vectors back, their gradients in backward).
        herald_hot_sync: hot-row gradient sync (dense all-reduce or sparse exchange).
        herald_hot_sync_allreduce: of ``herald_hot_sync``, the bytes of the dense sync's all-reduce (the model of
            time prices them at the link's all-reduce rate).
    """

    lookups: float = 0.0
    hot_lookups: float = 0.0
    cold_remote_lookups: float = 0.0
    stock_table_wise: float = 0.0
    stock_row_wise: float = 0.0
    herald_cold_ids: float = 0.0
    herald_cold_pooled: float = 0.0
    herald_cold_grads: float = 0.0
    herald_hot_sync: float = 0.0
    herald_hot_sync_allreduce: float = 0.0

    @property
    def herald_cold(self) -> float:
        """Cold-path bytes: ids + lengths, pooled vectors, gradients."""
        return self.herald_cold_ids + self.herald_cold_pooled + self.herald_cold_grads

    @property
    def herald_total(self) -> float:
        """Herald's total: cold path + hot sync."""
        return self.herald_cold + self.herald_hot_sync

    @property
    def hot_lookup_share(self) -> float:
        """Share of the lookups served by replicas."""
        return self.hot_lookups / self.lookups if self.lookups > 0 else 0.0

    def __add__(self, other: "TableTraffic") -> "TableTraffic":
        return TableTraffic(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> Dict[str, float]:
        """All fields plus ``herald_cold``, ``herald_total`` and ``hot_lookup_share``."""
        return {**asdict(self), "herald_cold": self.herald_cold, "herald_total": self.herald_total,
                "hot_lookup_share": self.hot_lookup_share}


def table_traffic(lookups_per_step: torch.Tensor, touch_prob: torch.Tensor, hot_ids: torch.Tensor, sync: str,
                  world_size: int, local_batch_size: int, embedding_dim: int, num_features: int = 1
                  ) -> TableTraffic:
    """Expected :class:`TableTraffic` of one table with hot set ``hot_ids`` synced by ``sync``.

    Args:
        lookups_per_step: ``λ`` per row (float64 ``[n]``), expected lookups per global step.
        touch_prob: ``P`` per row (``[n]``), probability that a local batch touches the row.
        hot_ids: replicated rows (int64, unique).
        sync: ``"dense"``, ``"sparse"`` or ``"none"`` (only with no hot rows).
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    if sync == "none" and hot_ids.numel():
        raise ValueError("sync 'none' needs an empty hot set")
    lam = lookups_per_step.to(torch.float64)
    hot = torch.zeros(lam.numel(), dtype=torch.bool)
    hot[hot_ids] = True
    hot_lookups = _total(lam[hot])
    cold_lookups = _total(lam[~hot])
    ids_b, pooled_b, grads_b = cold_bytes_breakdown(cold_lookups, world_size, embedding_dim)
    if sync == "dense":
        sync_b = dense_sync_bytes(int(hot_ids.numel()), world_size, embedding_dim)
    elif sync == "sparse":
        sync_b = sparse_sync_bytes(touch_prob[hot], world_size, embedding_dim)
    else:
        sync_b = 0.0
    g = world_size * local_batch_size
    total = _total(lam)
    return TableTraffic(
        lookups=total, hot_lookups=hot_lookups, cold_remote_lookups=cold_lookups * remote_fraction(world_size),
        stock_table_wise=stock_table_wise_bytes(total, g, world_size, embedding_dim, num_features),
        stock_row_wise=stock_row_wise_bytes(total, g, world_size, embedding_dim, num_features),
        herald_cold_ids=ids_b, herald_cold_pooled=pooled_b, herald_cold_grads=grads_b, herald_hot_sync=sync_b,
        herald_hot_sync_allreduce=sync_b if sync == "dense" else 0.0,
    )


# ---------------------------------------------------------------------- interface


@dataclass
class HotSetChoice:
    """The replicated rows of one table, how they are synced, and what that is expected to cost.

    Attributes:
        table: table name.
        hot_ids: sorted, unique int64 rows replicated on every rank (empty: the table is plain row-wise).
        sync: ``"dense"`` / ``"sparse"`` hot-gradient sync, ``"none"`` when there are no hot rows.
        replica_bytes_per_rank: memory of the replicas on each rank, ``h·(4D + 4)``.
        expected: expected traffic per step with this choice (and the stock references).
    """

    table: str
    hot_ids: torch.Tensor
    sync: str
    replica_bytes_per_rank: int
    expected: TableTraffic = field(default_factory=TableTraffic)

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if (self.sync == "none") != (self.hot_ids.numel() == 0):
            raise ValueError(f"table {self.table!r}: sync {self.sync!r} with {self.hot_ids.numel()} hot rows")

    @property
    def num_hot(self) -> int:
        """Number of replicated rows."""
        return int(self.hot_ids.numel())

    def describe(self) -> str:
        """One line for plan printouts."""
        e = self.expected
        return (f"{self.table}: {self.num_hot} hot rows ({self.sync}), replica {self.replica_bytes_per_rank} B/rank, "
                f"{e.hot_lookup_share * 100:.1f} % of lookups local; expected B/step stock TW "
                f"{e.stock_table_wise:.0f}, RW {e.stock_row_wise:.0f}, herald {e.herald_total:.0f} "
                f"(cold {e.herald_cold:.0f} + sync {e.herald_hot_sync:.0f})")


class HotSetSelector(abc.ABC):
    """Chooses each table's hot (replicated) row set from access statistics."""

    @abc.abstractmethod
    def select(self, stats: AccessStats, tables: Sequence[EmbeddingBagConfig], world_size: int,
               local_batch_size: int, memory_budget_bytes: Optional[int]) -> Dict[str, HotSetChoice]:
        """One :class:`HotSetChoice` per table of ``tables`` (keyed by table name, in table order).

        Args:
            stats: access statistics of ``tables`` (validated against them).
            tables: the model's table configs.
            world_size: ``W``, number of ranks.
            local_batch_size: ``B``, samples per rank per step.
            memory_budget_bytes: replica memory allowed per rank over all tables (``None``: no limit).
        """


@dataclass
class _TableInput:
    """What the selectors need of one table, on its sampled rows only.

    A row that was never sampled (zero ``counts`` and ``sample_counts``) has ``λ = P = 0``: its net
    benefit is ``−2·(W−1)·4D`` dense and ``0`` sparse, so the cost model never replicates it, and it adds
    nothing to any byte total. Working on the sampled rows (a few percent of the rows of a large table)
    gives the same choices as working on all ``n`` rows, at a fraction of the cost.
    """

    name: str
    dim: int
    num_features: int
    num_rows: int  # n
    rows: torch.Tensor  # int64 [m] ascending: the sampled rows
    lam: torch.Tensor  # float64 [m] lookups per global step of ``rows``
    touch: torch.Tensor  # float64 [m] P(touched by a local batch) of ``rows``


def _prepare(stats: AccessStats, tables: Sequence[EmbeddingBagConfig], world_size: int, local_batch_size: int,
             memory_budget_bytes: Optional[int]) -> List[_TableInput]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if memory_budget_bytes is not None and memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes must be >= 0 or None, got {memory_budget_bytes}")
    stats.validate(tables)
    g = world_size * local_batch_size
    inputs: List[_TableInput] = []
    for t in tables:
        rows = stats._sampled_rows(t.name)
        inputs.append(_TableInput(
            name=t.name, dim=int(t.embedding_dim), num_features=len(t.feature_names),
            num_rows=int(t.num_embeddings), rows=rows, lam=stats._lookups_per_step(t.name, g, rows),
            touch=touch_probability(stats._sample_probability(t.name, rows), local_batch_size)))
    return inputs


def _by_descending_lookups(lam: torch.Tensor) -> torch.Tensor:
    """Indices of ``lam`` by descending ``λ`` (ties: ascending index)."""
    return torch.sort(lam, descending=True, stable=True).indices


def _top_rows(t: _TableInput, k: int) -> torch.Tensor:
    """The first ``k`` rows of the whole table by descending ``λ`` (ties: ascending row id), as a sort of
    all ``n`` rows would give: sampled rows with ``λ > 0``, then every row with ``λ = 0`` (unsampled ones
    included) by ascending id, then rows with ``λ < 0`` (possible in hand-made stats only)."""
    order = _by_descending_lookups(t.lam)
    ordered = t.lam[order]
    positive = int((ordered > 0).sum())
    if k <= positive:
        return t.rows[order[:k]]
    zero = torch.ones(t.num_rows, dtype=torch.bool)
    zero[t.rows] = False
    zero[t.rows[t.lam == 0]] = True
    sampled_zero = int((ordered == 0).sum())
    return torch.cat([t.rows[order[:positive]], torch.nonzero(zero).flatten(),
                      t.rows[order[positive + sampled_zero:]]])[:k]


def _locate(t: _TableInput, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(position in t.rows, sampled?)`` of each of ``rows`` (positions of unsampled rows are meaningless)."""
    pos = torch.searchsorted(t.rows, rows)
    if t.rows.numel() == 0:
        return pos, torch.zeros(rows.numel(), dtype=torch.bool)
    pos = pos.clamp_(max=t.rows.numel() - 1)
    return pos, t.rows[pos] == rows


def _lookups_at(t: _TableInput, rows: torch.Tensor) -> torch.Tensor:
    """``λ`` of any rows of the table (zero for unsampled ones)."""
    if t.rows.numel() == 0:
        return torch.zeros(rows.numel(), dtype=torch.float64)
    pos, sampled = _locate(t, rows)
    return torch.where(sampled, t.lam[pos], 0.0)


def _enforce_budget(candidates: List[torch.Tensor], scores: List[torch.Tensor], row_bytes: List[int],
                    budget: Optional[int]) -> List[torch.Tensor]:
    """Keep candidate rows (all tables together) in descending ``score / row_bytes`` while the per-rank
    budget holds; a row that does not fit is skipped and smaller later rows may still fit (greedy fill,
    one vectorised pass per row size). Returns the kept rows per table (in candidate order)."""
    if budget is None:
        return candidates
    sizes = torch.cat([torch.full((c.numel(),), b, dtype=torch.int64) for c, b in zip(candidates, row_bytes)])
    density = torch.cat([s.to(torch.float64) / b for s, b in zip(scores, row_bytes)])
    order = torch.sort(density, descending=True, stable=True).indices
    keep = torch.zeros(order.numel(), dtype=torch.bool)
    remaining = int(budget)
    pending = order
    while pending.numel():
        pending = pending[sizes[pending] <= remaining]
        if not pending.numel():
            break
        cum = torch.cumsum(sizes[pending], 0)
        n_fit = int((cum <= remaining).sum())  # a prefix, the cumsum is increasing
        keep[pending[:n_fit]] = True
        remaining -= int(cum[n_fit - 1]) if n_fit else 0
        pending = pending[n_fit + 1:]  # the first row that did not fit is skipped for good
    offsets = [0]
    for c in candidates:
        offsets.append(offsets[-1] + c.numel())
    return [c[keep[offsets[i]:offsets[i + 1]]] for i, c in enumerate(candidates)]


def _warn_if_nothing_fits(candidates: List[torch.Tensor], kept: List[torch.Tensor], row_bytes: List[int],
                          budget: Optional[int]) -> None:
    if budget is None or not any(c.numel() for c in candidates) or any(k.numel() for k in kept):
        return
    smallest = min(b for c, b in zip(candidates, row_bytes) if c.numel())
    logger.warning("planner.hot_memory_budget_bytes: a budget of %d B per rank is smaller than one hot row "
                   "(%d B, the smallest budget that replicates any row): no rows are replicated, every table keeps "
                   "its cold rows row-wise (a herald plan with no hot rows)", budget, smallest)


def _choice(t: _TableInput, hot: torch.Tensor, sync: str, world_size: int, local_batch_size: int) -> HotSetChoice:
    """``hot`` (row ids) as a choice; its traffic is :func:`table_traffic` over the sampled rows (the others
    add zero), with any unsampled hot rows appended as rows of zero ``λ`` and ``P``."""
    hot_ids = torch.sort(hot.to(torch.int64)).values
    if hot_ids.numel() == 0:
        sync = "none"
    pos, sampled = _locate(t, hot_ids)
    lam, touch, hot_pos = t.lam, t.touch, pos[sampled]
    unsampled = int((~sampled).sum())
    if unsampled:
        m = t.rows.numel()
        lam = torch.cat([lam, torch.zeros(unsampled, dtype=torch.float64)])
        touch = torch.cat([touch, torch.zeros(unsampled, dtype=torch.float64)])
        hot_pos = torch.cat([hot_pos, torch.arange(m, m + unsampled)])
    traffic = table_traffic(lam, touch, hot_pos, sync, world_size, local_batch_size, t.dim, t.num_features)
    return HotSetChoice(table=t.name, hot_ids=hot_ids, sync=sync,
                        replica_bytes_per_rank=int(hot_ids.numel()) * hot_row_bytes(t.dim), expected=traffic)


class CostModelHotSetSelector(HotSetSelector):
    """The P²RES-style performance model (see the module docstring for the byte formulas).

    Per table and per sync mode, rows are taken by descending ``λ`` with net benefit
    ``net_x = saving_x − cost_x`` (``saving_x = λ_x·(W−1)/W·(8 + 8D)``; ``cost_x = 2·(W−1)·4D`` dense,
    ``W·(W−1)·(4 + 4D)·P_x`` sparse) and kept while ``net_x > 0``. Since the costs are additive per row,
    this keeps exactly the rows with positive net (a prefix of the λ order for one-id features, where
    ``P_x`` grows with ``λ_x``). Each table uses the mode with the larger total net benefit (ties: dense;
    no positive row: no hot set). Then the per-rank memory budget is enforced over all tables by taking
    the candidate rows in descending net benefit per byte of replica until it is spent; finally each
    table re-picks the cheaper sync mode for the rows it kept (a no-op unless the budget cut rows).
    A budget smaller than one row leaves every table empty and logs a warning.

    ``pricing`` (``planner/pricing.py``) turns the bytes into the unit the nets are reported in: bytes
    (:class:`~torchrec_herald.planner.pricing.ByteCount`, the default) or milliseconds on a link
    (:class:`~torchrec_herald.planner.pricing.LinkModel`). Every term is bytes, so the rows chosen are the same
    in either unit: the link decides whether herald's plan trains at all (``HeraldPlanner.decide``), not which
    rows it replicates.
    """

    def __init__(self, pricing: Optional[Pricing] = None) -> None:
        self.pricing: Pricing = pricing if pricing is not None else ByteCount()

    def select(self, stats: AccessStats, tables: Sequence[EmbeddingBagConfig], world_size: int,
               local_batch_size: int, memory_budget_bytes: Optional[int]) -> Dict[str, HotSetChoice]:
        inputs = _prepare(stats, tables, world_size, local_batch_size, memory_budget_bytes)
        candidates: List[torch.Tensor] = []
        scores: List[torch.Tensor] = []
        row_bytes: List[int] = []
        nets: List[Tuple[torch.Tensor, torch.Tensor]] = []
        price = self.pricing.bytes
        for t in inputs:
            saving = price(replication_saving(t.lam, world_size, t.dim))
            net_dense = saving - price(dense_sync_row_cost(world_size, t.dim))
            net_sparse = saving - price(sparse_sync_row_cost(t.touch, world_size, t.dim))
            nets.append((net_dense, net_sparse))
            total_dense = float(net_dense.clamp(min=0).sum())
            total_sparse = float(net_sparse.clamp(min=0).sum())
            if total_dense <= 0 and total_sparse <= 0:
                net = torch.zeros_like(saving)  # replication does not pay: no candidates
            else:
                net = net_dense if total_dense >= total_sparse else net_sparse
            # candidates: positions in t.rows with net > 0 (ascending row id), by descending λ
            pos = torch.nonzero(net > 0).flatten()
            pos = pos[_by_descending_lookups(t.lam[pos])]
            candidates.append(pos)
            scores.append(net[pos])
            row_bytes.append(hot_row_bytes(t.dim))
        kept = _enforce_budget(candidates, scores, row_bytes, memory_budget_bytes)
        _warn_if_nothing_fits(candidates, kept, row_bytes, memory_budget_bytes)
        out: Dict[str, HotSetChoice] = {}
        for t, pos, (net_dense, net_sparse) in zip(inputs, kept, nets):
            sync = "dense" if float(net_dense[pos].sum()) >= float(net_sparse[pos].sum()) else "sparse"
            out[t.name] = _choice(t, t.rows[pos], sync, world_size, local_batch_size)
        total = total_traffic(out.values())
        logger.info("CostModelHotSetSelector(W=%d, B=%d, budget=%s): %d hot rows, %d B/rank; expected B/step "
                    "stock TW %.0f, herald %.0f", world_size, local_batch_size, memory_budget_bytes,
                    sum(c.num_hot for c in out.values()), sum(c.replica_bytes_per_rank for c in out.values()),
                    total.stock_table_wise, total.herald_total)
        return out


class TopFractionHotSetSelector(HotSetSelector):
    """Baseline: the ``ceil(fraction·rows)`` most looked-up rows of every table (the fixed top-2 % hot
    set of the P²RES poster), whatever they cost, synced by ``sync`` (dense by default). Over budget,
    rows are kept in descending saving per byte (the cost model's greedy fill, scored by ``saving_x``)."""

    def __init__(self, fraction: float = 0.02, sync: str = "dense") -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if sync not in ("dense", "sparse"):
            raise ValueError(f"sync must be 'dense' or 'sparse', got {sync!r}")
        self.fraction = float(fraction)
        self.sync = sync

    def select(self, stats: AccessStats, tables: Sequence[EmbeddingBagConfig], world_size: int,
               local_batch_size: int, memory_budget_bytes: Optional[int]) -> Dict[str, HotSetChoice]:
        inputs = _prepare(stats, tables, world_size, local_batch_size, memory_budget_bytes)
        candidates = [_top_rows(t, math.ceil(self.fraction * t.num_rows)) for t in inputs]
        scores = [replication_saving(_lookups_at(t, c), world_size, t.dim) for t, c in zip(inputs, candidates)]
        row_bytes = [hot_row_bytes(t.dim) for t in inputs]
        kept = _enforce_budget(candidates, scores, row_bytes, memory_budget_bytes)
        _warn_if_nothing_fits(candidates, kept, row_bytes, memory_budget_bytes)
        return {t.name: _choice(t, rows, self.sync, world_size, local_batch_size) for t, rows in zip(inputs, kept)}


# ---------------------------------------------------------------------- printout


def total_traffic(choices: Union[Mapping[str, HotSetChoice], Iterable[HotSetChoice]]) -> TableTraffic:
    """Sum of the expected traffic of ``choices`` (a dict or an iterable of :class:`HotSetChoice`)."""
    items: Iterable[HotSetChoice] = choices.values() if isinstance(choices, Mapping) else choices
    total = TableTraffic()
    for c in items:
        total = total + c.expected
    return total


def format_traffic_report(choices: Dict[str, HotSetChoice]) -> str:
    """Per-table lines (hot rows, sync, replica memory, expected bytes per step stock vs herald) and a total."""
    lines = [f"{'table':<12} {'hot':>8} {'sync':>6} {'replica KiB':>11} {'local %':>7} {'stock TW':>12} "
             f"{'stock RW':>12} {'herald':>12} {'cold':>12} {'sync B':>10}"]
    for c in choices.values():
        e = c.expected
        lines.append(f"{c.table:<12} {c.num_hot:>8} {c.sync:>6} {c.replica_bytes_per_rank / 1024:>11.1f} "
                     f"{e.hot_lookup_share * 100:>7.1f} {e.stock_table_wise:>12.0f} {e.stock_row_wise:>12.0f} "
                     f"{e.herald_total:>12.0f} {e.herald_cold:>12.0f} {e.herald_hot_sync:>10.0f}")
    t = total_traffic(choices)
    ratio = t.herald_total / t.stock_table_wise if t.stock_table_wise > 0 else float("nan")
    lines.append(f"{'total':<12} {sum(c.num_hot for c in choices.values()):>8} {'':>6} "
                 f"{sum(c.replica_bytes_per_rank for c in choices.values()) / 1024:>11.1f} "
                 f"{t.hot_lookup_share * 100:>7.1f} {t.stock_table_wise:>12.0f} {t.stock_row_wise:>12.0f} "
                 f"{t.herald_total:>12.0f} {t.herald_cold:>12.0f} {t.herald_hot_sync:>10.0f}")
    share = f"{ratio * 100:.1f} % of TABLE_WISE" if t.stock_table_wise > 0 else "no bytes leave a rank"
    lines.append(f"expected bytes/step (all ranks): stock TABLE_WISE {t.stock_table_wise:.0f}, stock ROW_WISE "
                 f"{t.stock_row_wise:.0f}, herald {t.herald_total:.0f} ({share})")
    return "\n".join(lines)
