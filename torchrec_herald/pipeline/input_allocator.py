"""Herald's location-aware input allocator (docs/design.md §3, Herald (a)): which rank trains which sample.

Every rank knows every sample of the global batch (its ids, after an all-gather of ids or of a compact
per-sample owner signature; that exchange and the sample shuffle that follows are *not* done here).
The allocator scores each (sample, rank) pair by the number of the sample's lookups that are local to
the rank, and assigns samples to ranks so that local lookups go up while every rank still trains
exactly ``B = G // W`` samples (TorchRec's row-wise backward fails on uneven local batches).

Locality (:class:`Locality`) follows herald's sharding (``torchrec_herald/sharding/hot_replicated.py``):

* a **hot** id of a table (``HotSpec.hot_ids``) is replicated on every rank: local everywhere;
* a **cold** id ``x`` of a table with ``n`` rows lives in stock ROW_WISE blocks: it is local only on
  its owner ``x // ceil(n / W)``;
* optionally, a rank may hold a **valid cache entry** of a remote cold row (Herald's cache, for a later
  communication plan): local on the caching ranks too.

Everything here is a pure, deterministic function of its inputs (integer arithmetic only, ties broken
by explicit rules), so every rank computing an assignment on the same global batch gets the same one.

What has to be exchanged: :func:`greedy_assign` needs only the ``[G, W]`` score matrix, and a score row
depends only on its own sample, so each rank can score its own ``B`` samples (``score(local_kjt,
locality, W)`` gives ``[B, W]``), all-gather those rows (``W·(W−1)·B·W`` counts per step, 2 B each as
int16: a compact per-sample owner signature) and run ``greedy_assign(torch.cat(rows), step)``; all-gathering
the ids themselves costs ``W·(W−1)·B·L̄`` ids (``L̄`` lookups per sample) instead. Weighted KJTs are scored
by lookup count (weights ignored).

Allocators (all :class:`InputAllocator`, built by name with :func:`build_allocator`):

* ``identity`` (:class:`IdentityAllocator`): sample ``s`` -> rank ``s // B``, what stock TorchRec does;
* ``greedy`` (:class:`GreedyLocalityAllocator`): full score over all tables, greedy with room limits;
* ``topk_tables`` (:class:`TopKTablesAllocator`): the same greedy scoring only the ``k`` tables with
  the most cold lookups (cheaper to gather and to score).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.layout import RowLayout
from torchrec_herald.native import load_if_built
from torchrec_herald.plans import scores_from_local_on
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, hot_spec_of

__all__ = [
    "CacheMembership",
    "GreedyLocalityAllocator",
    "IdentityAllocator",
    "InputAllocator",
    "Locality",
    "TIE_BREAKS",
    "TopKTablesAllocator",
    "build_allocator",
    "cold_lookups_per_table",
    "greedy_assign",
    "local_batch_size",
    "local_lookup_share",
    "moved_samples",
    "priced_move_penalty",
    "remote_cold_lookups",
    "score",
    "top_cold_tables",
]

#: Per-rank cache membership: either ``fn(table, ids) -> bool [N, W]`` (True where rank r holds a
#: valid cache entry of row ``ids[i]``) or ``{table: [sorted ids cached on rank 0, ..., rank W-1]}``.
CacheMembership = Union[Callable[[str, torch.Tensor], torch.Tensor], Mapping[str, Sequence[torch.Tensor]]]


# ---------------------------------------------------------------------------------------- locality


@dataclass(eq=False)
class Locality:
    """What is local to which rank, from the table layout (herald: hot rows everywhere, cold rows on
    their ROW_WISE owner, optional per-rank cache entries).

    Build it with :meth:`from_plan` (a herald ``ShardingPlan``) or :meth:`from_tables`, or directly:

    Args:
        world_size: ``W``, the ranks the layout is for.
        num_embeddings: table -> rows (the table order is this mapping's order).
        hot_ids: table -> hot (replicated) row ids; a missing table has none. Sorted and deduplicated here.
        features: KJT feature -> table serving it; default: every table serves the feature of its own name.
        block_sizes: table -> ROW_WISE block size (owner of a cold id ``x`` is ``x // block``); default
            ``ceil(n / W)``, stock ROW_WISE's (and herald's) blocks.
        cache: optional :data:`CacheMembership` ("valid cache entry" on a rank); default none.
    """

    world_size: int
    num_embeddings: Dict[str, int]
    hot_ids: Dict[str, torch.Tensor] = field(default_factory=dict)
    features: Optional[Dict[str, str]] = None
    block_sizes: Optional[Dict[str, int]] = None
    cache: Optional[CacheMembership] = None

    def __post_init__(self) -> None:
        self.layout: RowLayout = RowLayout.build(self.world_size, self.num_embeddings, self.hot_ids, self.features,
                                                 self.block_sizes)
        lay = self.layout
        self.num_embeddings = dict(zip(lay.tables, lay.num_embeddings))
        self.tables: List[str] = list(lay.tables)
        self.hot_ids = dict(zip(lay.tables, lay.hot_ids))
        self.features = {f: lay.tables[int(t)] for f, t in zip(lay.features, lay.feature_table)}
        self.block_sizes = dict(zip(lay.tables, lay.block_sizes))
        if self.cache is not None and not callable(self.cache):
            cache: Dict[str, List[torch.Tensor]] = {}
            for t, per_rank in self.cache.items():
                if t not in self.num_embeddings:
                    raise ValueError(f"cache entries for unknown table {t!r}")
                if len(per_rank) != self.world_size:
                    raise ValueError(f"table {t!r}: cache needs one id set per rank ({self.world_size}), "
                                     f"got {len(per_rank)}")
                cache[t] = [torch.unique(torch.as_tensor(s, dtype=torch.int64).flatten()) for s in per_rank]
            self.cache = cache

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_tables(cls, tables: Sequence[EmbeddingBagConfig], world_size: int,
                    hot_ids: Optional[Mapping[str, torch.Tensor]] = None,
                    cache: Optional[CacheMembership] = None) -> "Locality":
        """Locality of ``tables`` (each serving its ``feature_names``) with stock ROW_WISE blocks."""
        return cls(world_size=world_size, num_embeddings={t.name: t.num_embeddings for t in tables},
                   hot_ids=dict(hot_ids or {}), features={f: t.name for t in tables for f in t.feature_names},
                   cache=cache)

    @classmethod
    def from_plan(cls, plan: ShardingPlan, tables: Sequence[EmbeddingBagConfig],
                  cache: Optional[CacheMembership] = None) -> "Locality":
        """Locality of ``tables`` under ``plan``: a herald table's hot ids are its
        ``HeraldParameterSharding.hot.hot_ids``; a stock ROW_WISE table has none (cold blocks only).

        Raises:
            ValueError: a table not in the plan, a table neither herald nor ROW_WISE (its rows are
                not in ``id // block`` blocks), ranks other than ``0..W-1``, or tables on different
                numbers of ranks.
        """
        shardings: Dict[str, Any] = {}
        for module_plan in plan.plan.values():
            for name, ps in module_plan.items():  # type: ignore[union-attr]
                shardings[name] = ps
        hot: Dict[str, torch.Tensor] = {}
        world: Optional[int] = None
        for t in tables:
            ps = shardings.get(t.name)
            if ps is None:
                raise ValueError(f"table {t.name!r} is not in the sharding plan (planned: {sorted(shardings)})")
            if ps.sharding_type not in (HERALD_HOT_ROW_WISE, ShardingType.ROW_WISE.value):
                raise ValueError(f"table {t.name!r}: sharding type {ps.sharding_type!r} is not supported by the "
                                 f"input allocator ({HERALD_HOT_ROW_WISE} or {ShardingType.ROW_WISE.value})")
            ranks = list(ps.ranks or [])
            if ranks != list(range(len(ranks))) or not ranks:
                raise ValueError(f"table {t.name!r}: row-wise shards on ranks {ranks}, expected 0..W-1")
            if world is not None and len(ranks) != world:
                raise ValueError(f"table {t.name!r} is sharded over {len(ranks)} ranks, others over {world}")
            world = len(ranks)
            spec = hot_spec_of(ps)
            hot[t.name] = spec.hot_ids if spec is not None else torch.empty(0, dtype=torch.int64)
        if world is None:
            raise ValueError("Locality.from_plan: no tables")
        return cls.from_tables(tables, world, hot, cache)

    # ------------------------------------------------------------------ queries

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(f"world_size {world_size} does not match the locality's ({self.world_size})")

    def table_of_features(self, keys: Sequence[str]) -> torch.Tensor:
        """int64 [F] table index of each KJT key (ValueError naming an unknown key)."""
        assert self.features is not None
        unknown = [k for k in keys if k not in self.features]
        if unknown:
            raise ValueError(f"KJT keys {unknown} are not served by any table (features: {sorted(self.features)})")
        return torch.tensor([self.layout.table_index[self.features[k]] for k in keys], dtype=torch.int64)

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]`` over global keys (``layout``'s): rank r holds row ``keys[i]`` as a hot
        replica, in its own block, or as a valid cache entry — what :func:`score` counts."""
        lay = self.layout
        keys = torch.as_tensor(keys, dtype=torch.int64)
        ranks = torch.arange(self.world_size).unsqueeze(1)
        table = lay.table_of(keys)
        out = lay.is_hot(keys).unsqueeze(0) | (lay.home_of(keys, table).unsqueeze(0) == ranks)
        if self.cache is not None:
            for ti, name in enumerate(self.tables):
                idx = (table == ti).nonzero().flatten()
                cached = self.cached_on(name, keys[idx] - lay.table_offsets[ti]) if idx.numel() else None
                if cached is not None:
                    out[:, idx] |= cached.T
        return out

    def cached_on(self, table: str, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """bool [N, W]: rank r holds a valid cache entry of row ``ids[i]`` of ``table`` (None: no cache)."""
        if self.cache is None:
            return None
        if callable(self.cache):
            out = torch.as_tensor(self.cache(table, ids), dtype=torch.bool)
            if out.shape != (ids.numel(), self.world_size):
                raise ValueError(f"cache({table!r}, ids) returned shape {tuple(out.shape)}, expected "
                                 f"({ids.numel()}, {self.world_size})")
            return out
        per_rank = self.cache.get(table)
        if per_rank is None:
            return None
        cols = []
        for s in per_rank:
            if s.numel() == 0:
                cols.append(torch.zeros(ids.numel(), dtype=torch.bool))
                continue
            pos = torch.searchsorted(s, ids).clamp_(max=s.numel() - 1)
            cols.append(s[pos] == ids)
        return torch.stack(cols, 1)


# ---------------------------------------------------------------------------------------- scoring


@dataclass
class _Lookups:
    """The lookups of a global batch, flat: one entry per id."""

    num_samples: int
    sample: torch.Tensor  # int64 [N]
    table: torch.Tensor  # int64 [N] table index
    ids: torch.Tensor  # int64 [N]
    hot: torch.Tensor  # bool [N]
    owner: torch.Tensor  # int64 [N] ROW_WISE owner


def _lookups(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int,
             tables: Optional[Sequence[str]] = None) -> _Lookups:
    locality.check_world_size(world_size)
    if global_kjt.variable_stride_per_key():
        raise ValueError("variable-stride (VBE) KJTs are not supported by the input allocator")
    keys = list(global_kjt.keys())
    g = int(global_kjt.stride())
    feature_table = locality.table_of_features(keys)
    values = global_kjt.values().detach().to("cpu", torch.int64)
    lengths = global_kjt.lengths().detach().to("cpu", torch.int64)
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    table = feature_table[bag // g] if keys else torch.empty(0, dtype=torch.int64)
    sample = bag % g
    lay = locality.layout
    bad = (values < 0) | (values >= lay.rows[table])
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"feature {keys[int(bag[i]) // g]!r}: id {int(values[i])} is outside "
                         f"[0, {int(lay.rows[table[i]])})")
    if tables is not None:
        wanted = torch.zeros(len(locality.tables), dtype=torch.bool)
        for t in tables:
            if t not in lay.table_index:
                raise ValueError(f"unknown table {t!r} (tables: {locality.tables})")
            wanted[lay.table_index[t]] = True
        keep = wanted[table]
        sample, table, values = sample[keep], table[keep], values[keep]
    hot_keys = lay.hot_keys
    if hot_keys.numel():
        keys_ = lay.table_offsets[table] + values
        pos = torch.searchsorted(hot_keys, keys_).clamp_(max=hot_keys.numel() - 1)
        hot = hot_keys[pos] == keys_
    else:
        hot = torch.zeros(values.numel(), dtype=torch.bool)
    owner = values // lay.blocks[table]
    return _Lookups(num_samples=g, sample=sample, table=table, ids=values, hot=hot, owner=owner)


def _score(lk: _Lookups, locality: Locality) -> torch.Tensor:
    g, w = lk.num_samples, locality.world_size
    hot_per_sample = torch.bincount(lk.sample[lk.hot], minlength=g)
    cold = ~lk.hot
    out = torch.bincount(lk.sample[cold] * w + lk.owner[cold], minlength=g * w).view(g, w)
    out += hot_per_sample.unsqueeze(1)
    if locality.cache is not None:
        cold_idx = cold.nonzero().flatten()
        for ti, t in enumerate(locality.tables):
            idx = cold_idx[lk.table[cold_idx] == ti]
            if not idx.numel():
                continue
            cached = locality.cached_on(t, lk.ids[idx])
            if cached is None:
                continue
            cached = cached.clone()
            cached[torch.arange(idx.numel()), lk.owner[idx]] = False  # the owner already counts it
            pair = cached.nonzero()
            out += torch.bincount(lk.sample[idx[pair[:, 0]]] * w + pair[:, 1], minlength=g * w).view(g, w)
    return out


def score(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int,
          tables: Optional[Sequence[str]] = None) -> torch.Tensor:
    """int64 ``[G, W]``: how many lookups of sample ``s`` are local to rank ``r``.

    A hot id counts on every rank, a cold id on its ROW_WISE owner and on every rank holding a valid
    cache entry of it. Vectorised over all lookups of all features. ``tables``: score only these
    tables' lookups (default: all).
    """
    return _score(_lookups(global_kjt, locality, world_size, tables), locality)


def cold_lookups_per_table(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int) -> torch.Tensor:
    """int64 ``[T]`` (table order of ``locality``): cold (non-hot) lookups of each table in the batch."""
    lk = _lookups(global_kjt, locality, world_size)
    return torch.bincount(lk.table[~lk.hot], minlength=len(locality.tables))


def _top_k(traffic: torch.Tensor, names: Sequence[str], k: int) -> List[str]:
    """The ``k`` names with the largest traffic (ties: table order), returned in table order."""
    order = torch.sort(traffic, descending=True, stable=True).indices[:k]
    return [names[i] for i in sorted(order.tolist())]


def top_cold_tables(stats: Any, locality: Locality, k: int) -> List[str]:
    """The ``k`` tables with the most expected cold lookups per sample under ``locality``'s hot sets,
    from a ``torchrec_herald.planner.AccessStats`` (a fixed choice: only their ids need gathering)."""
    traffic = []
    for t in locality.tables:
        counts = stats.counts[t].to(torch.float64)
        cold = counts.sum() - counts[locality.hot_ids[t]].sum()
        traffic.append(float(cold) / max(1, stats.num_samples))
    return _top_k(torch.tensor(traffic, dtype=torch.float64), locality.tables, k)


# ---------------------------------------------------------------------------------------- allocators


def local_batch_size(num_samples: int, world_size: int) -> int:
    """``B = G // W``; ValueError unless ``W >= 1`` divides ``G``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_samples % world_size:
        raise ValueError(f"the global batch has {num_samples} samples, not a multiple of world_size={world_size}: "
                         f"every rank must get the same number of samples")
    return num_samples // world_size


#: how :func:`greedy_assign` breaks score ties between ranks
TIE_BREAKS = ("rotate", "home")


def greedy_assign(scores: torch.Tensor, step: int, tie_break: str = "rotate", move_penalty: int = 0) -> torch.Tensor:
    """Greedy room-limited assignment of ``G`` samples to ``W`` ranks, exactly ``G // W`` per rank.

    * Rank preference of a sample: descending score; ties by ``(r - step) % W`` ascending (at step 0
      rank 0 first, at step 1 rank 1 first, ...), so tied samples land on a different rank each step.
      ``tie_break="home"`` first prefers, among tied ranks, the sample's home rank ``s // B`` (where
      the data loader put it: no exchange needed), then rotates as above.
    * ``move_penalty`` (lookups, default 0): the home rank's score is raised by this much before
      anything else, so a sample only leaves home when that gains more than ``move_penalty`` local
      lookups (moving a sample costs its dense features, ids and label on the exchange; one remote
      cold lookup costs ``8 + 8D`` bytes, see ``planner/hot_set.py``).
    * Sample order: descending ``W·max_r score − Σ_r score`` (= ``W`` times max minus mean: how much the
      sample loses when it is not on its best rank, on average), ties by sample index. Samples with a
      strong preference are placed while their best rank still has room; samples that are local
      everywhere or nowhere (all scores equal) go last and fill whatever room is left. Measured on
      the default synthetic data (scale 0.01, cost-model hot sets, W=4, B=256, 20 global batches):
      local lookup share 0.9445 with this order, 0.9432 ordering by best minus second-best score,
      0.9385 in sample order; the unconstrained bound (every sample on its best rank) is 0.9448.
    * Each sample goes to its most preferred rank that still has room.

    Pure integer arithmetic and total orders: every rank computes the same assignment.
    """
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    if move_penalty < 0:
        raise ValueError(f"move_penalty must be >= 0, got {move_penalty}")
    local_batch_size(*scores.shape)  # (raises where the samples do not split evenly over the ranks)
    native = load_if_built() if scores.device.type == "cpu" and not scores.is_floating_point() else None
    if native is not None:  # the same greedy, one sample at a time in compiled code (native/greedy_assign.cpp)
        return native.greedy_assign(scores, int(step), tie_break == "home", int(move_penalty))
    return _greedy_assign_by_rounds(scores, step, tie_break, move_penalty)


def _greedy_assign_by_rounds(scores: torch.Tensor, step: int, tie_break: str, move_penalty: int) -> torch.Tensor:
    """:func:`greedy_assign` in torch ops (the compiled module's reference, and its stand-in where the module is
    not built): the sequential greedy vectorised by rounds."""
    g, w = scores.shape
    b = local_batch_size(g, w)
    # keys in int32 where they fit ([G, W] is the allocator's largest tensor: 4 bytes a score, not 8)
    top = (int(scores.max()) if g else 0) + int(move_penalty)
    dtype = torch.int32 if (top + 1) * 2 * w < 2 ** 31 else torch.int64
    scores = scores.to(dtype)
    if move_penalty and g:
        scores = scores + int(move_penalty) * (torch.arange(g).unsqueeze(1) // b == torch.arange(w).unsqueeze(0))
    pref = (torch.arange(w, dtype=dtype) - step) % w  # 0 = most preferred on ties
    priority = (w * scores.max(1).values.to(torch.int64) - scores.sum(1, dtype=torch.int64)
                if g else torch.empty(0, dtype=torch.int64))
    sample_order = torch.sort(priority, descending=True, stable=True).indices
    if tie_break == "home" and g:
        home = torch.arange(g).unsqueeze(1) // b == torch.arange(w).unsqueeze(0)
        key = scores * (2 * w) + home.to(dtype) * w + (w - 1 - pref)
    else:
        key = scores.mul(w).add_(w - 1 - pref)  # distinct per row: a total order of the ranks
    del scores
    # The sequential greedy, vectorised by rounds: until the next rank fills up, every sample simply takes
    # its most preferred rank with room (largest key), so a round places the samples up to the one that
    # fills a rank, and there are at most W rounds. Each sample's choice is kept between rounds and
    # recomputed only when its chosen rank fills (O(G log G) per round, not O(G·W)).
    key = key.index_select(0, sample_order)  # in placement order
    placed = torch.empty(g, dtype=torch.int64)
    room = torch.full((w,), b, dtype=torch.int64)
    choice = key.argmax(1) if g else torch.empty(0, dtype=torch.int64)
    p = 0
    while p < g:
        with_room = (room > 0).nonzero().flatten()
        if with_room.numel() == 1:  # the last rank with room takes the rest
            placed[p:] = with_room[0]
            break
        c = choice[p:]
        counts = torch.bincount(c, minlength=w)
        fills = (counts >= room) & (room > 0)
        if not bool(fills.any()):  # (cannot happen: the samples left exactly fill the room left)
            placed[p:] = c
            break
        order = torch.sort(c, stable=True).indices
        first = torch.cumsum(counts, 0) - counts
        where = order.index_select(0, (first + room - 1).clamp(0, c.numel() - 1))  # each rank's last sample that fits
        where = torch.where(fills, where, torch.full_like(where, g))
        n = int(where.min()) + 1  # the first sample that fills a rank ends the round
        full = int(where.argmin())
        placed[p:p + n] = c[:n]
        room -= torch.bincount(c[:n], minlength=w)
        p += n
        again = (choice[p:] == full).nonzero().flatten() + p  # later samples that chose the full rank
        if again.numel():
            choice[again] = key.index_select(0, again).masked_fill_((room == 0).unsqueeze(0),
                                                                    torch.iinfo(key.dtype).min).argmax(1)
    return torch.empty(g, dtype=torch.int64).index_copy_(0, sample_order, placed)


def priced_move_penalty(sample_bytes: float, lookup_bytes: float) -> int:
    """The ``move_penalty`` at which a move pays in time: a sample leaves home only where the local lookups it
    gains save more link time than its own bytes take on the same link (the rate cancels, so bytes decide).
    ``greedy_assign`` may move a sample that gains exactly ``move_penalty`` lookups (ties rotate), so the
    penalty is the least whole number of lookups whose bytes exceed the sample's: ``floor(s / l) + 1``
    (0 where a move sends nothing: whole global batches, every rank already holds every sample).

    Args:
        sample_bytes: bytes one moved sample sends (dense features, label, per-feature lengths, ids).
        lookup_bytes: bytes one lookup made local saves (a remote cold lookup: ``8 + 8D``,
            :func:`~torchrec_herald.planner.hot_set.cold_lookup_bytes`).
    """
    if lookup_bytes <= 0:
        raise ValueError(f"lookup_bytes must be > 0, got {lookup_bytes}")
    if sample_bytes < 0:
        raise ValueError(f"sample_bytes must be >= 0, got {sample_bytes}")
    return 0 if sample_bytes == 0 else int(sample_bytes // lookup_bytes) + 1


class InputAllocator(abc.ABC):
    """Decides which rank trains which sample of a global batch (a pure function of its inputs)."""

    #: whether the assignment uses the samples' local-lookup scores (HeraldTrainPipeline gathers them)
    needs_scores: bool = True

    def moves_at(self, priced: Optional[int]) -> bool:
        """Whether samples may move in a batch whose move penalty is priced at ``priced`` (None: not priced)."""
        return True

    @staticmethod
    def local_scores(keys: torch.Tensor, sample: torch.Tensor, num_samples: int,
                     local_on: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """int64 ``[num_samples, W]``: lookups of each sample local to each rank, from its global row
        ``keys`` (``sample[i]`` the sample of ``keys[i]``) and ``local_on`` (bool ``[W, n]``: a
        ``Locality``'s or a planner's), = :func:`score` (the pipeline's planners build the same sums
        sparsely: ``CommPlanner.local_scores``)."""
        return scores_from_local_on(local_on(keys), sample, num_samples)

    @abc.abstractmethod
    def assign(self, global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int, step: int) -> torch.Tensor:
        """``rank_of_sample``: int64 ``[G]`` with exactly ``B = G // W`` samples on every rank.

        Args:
            global_kjt: the sparse features of the whole global batch (``G = W·B`` samples, stride G).
            locality: what is local to which rank.
            world_size: ``W``.
            step: the training step (ties rotate with it).

        Raises:
            ValueError: ``G % W != 0``, a world size other than the locality's, unknown KJT keys, ids
                outside their table.
        """


class IdentityAllocator(InputAllocator):
    """Sample ``s`` -> rank ``s // B``: stock TorchRec's contiguous split (for comparisons)."""

    #: the assignment needs no scores (HeraldTrainPipeline then exchanges none)
    needs_scores = False

    def assign(self, global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int, step: int) -> torch.Tensor:
        locality.check_world_size(world_size)
        g = int(global_kjt.stride())
        b = local_batch_size(g, world_size)
        return torch.arange(g, dtype=torch.int64) // b if b else torch.empty(0, dtype=torch.int64)

    def __repr__(self) -> str:
        return "IdentityAllocator()"


class GreedyLocalityAllocator(InputAllocator):
    """Herald's location-aware allocator: the full :func:`score` over all tables, then
    :func:`greedy_assign` (exactly B per rank, ties rotating with the step).

    Args:
        tie_break: ``"rotate"`` (default; docs/design.md §3) or ``"home"`` (keep a tied sample on its home
            rank, fewer samples to exchange; see :func:`greedy_assign`).
        move_penalty: local lookups a move must gain (default 0; see :func:`greedy_assign`); ``None``: the
            caller prices it per batch (:meth:`assign_scores`'s ``priced``, e.g. :func:`priced_move_penalty`).
        max_priced: ``None`` (default), or move samples only in batches whose priced penalty is at most this
            (:meth:`moves_at`; ``pipeline.allocator=auto`` on per-rank batches: 1, a move only where one
            lookup made local saves more bytes than the sample sends).
    """

    def __init__(self, tie_break: str = "rotate", move_penalty: Optional[int] = 0,
                 max_priced: Optional[int] = None) -> None:
        if tie_break not in TIE_BREAKS:
            raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
        if move_penalty is not None and int(move_penalty) < 0:
            raise ValueError(f"move_penalty must be >= 0, got {move_penalty}")
        if max_priced is not None and int(max_priced) < 0:
            raise ValueError(f"max_priced must be >= 0, got {max_priced}")
        self.tie_break = tie_break
        self.move_penalty = None if move_penalty is None else int(move_penalty)
        self.max_priced = None if max_priced is None else int(max_priced)

    def moves_at(self, priced: Optional[int]) -> bool:
        """Whether samples may move in a batch priced at ``priced`` (None: not priced yet, they may)."""
        return self.max_priced is None or priced is None or priced <= self.max_priced

    def _tables(self, global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int) -> Optional[List[str]]:
        return None

    needs_scores = True

    def assign(self, global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int, step: int) -> torch.Tensor:
        local_batch_size(int(global_kjt.stride()), world_size)
        tables = self._tables(global_kjt, locality, world_size)
        return self.assign_scores(score(global_kjt, locality, world_size, tables), step)

    def assign_scores(self, scores: torch.Tensor, step: int, priced: int = 0) -> torch.Tensor:
        """The assignment from the ``[G, W]`` local-lookup scores (every rank the same): what
        HeraldTrainPipeline runs on the all-gathered scores of the ranks' own samples. ``priced``: the
        move penalty used when this allocator's own ``move_penalty`` is ``None`` (priced by the caller)."""
        return greedy_assign(scores, step, self.tie_break, self.penalty(priced))

    def penalty(self, priced: int = 0) -> int:
        """The move penalty in force: the allocator's own, else the caller's ``priced`` one."""
        return priced if self.move_penalty is None else self.move_penalty

    def __repr__(self) -> str:
        return (f"GreedyLocalityAllocator(tie_break={self.tie_break!r}, move_penalty={self.move_penalty}"
                + (f", max_priced={self.max_priced})" if self.max_priced is not None else ")"))


class TopKTablesAllocator(GreedyLocalityAllocator):
    """The cheaper variant: the same greedy, scoring only ``k`` tables, the ones with the most cold
    traffic: the tables whose ids must be gathered and scored are far fewer, and small or fully hot
    tables (whose lookups are local everywhere anyway) contribute nothing to the score.

    Args:
        k: number of tables to score (``k >= 1``; ``k >=`` the number of tables is ``greedy``).
        tables: a fixed table list (e.g. :func:`top_cold_tables` from the planner's AccessStats), so
            only those tables' ids need to be all-gathered. Default ``None``: per global batch, the
            ``k`` tables with the most cold (non-hot) lookups in that batch (ties: table order) — a
            pure function of the batch, so all ranks agree.
        tie_break, move_penalty: as for :class:`GreedyLocalityAllocator`.
    """

    def __init__(self, k: int, tables: Optional[Sequence[str]] = None, tie_break: str = "rotate",
                 move_penalty: Optional[int] = 0) -> None:
        super().__init__(tie_break, move_penalty)
        if int(k) < 1:
            raise ValueError(f"topk_tables needs k >= 1, got {k}")
        self.k = int(k)
        self.fixed_tables = list(tables) if tables is not None else None
        if self.fixed_tables is not None and len(self.fixed_tables) > self.k:
            raise ValueError(f"{len(self.fixed_tables)} fixed tables for k={self.k}")

    def _tables(self, global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int) -> Optional[List[str]]:
        if self.fixed_tables is not None:
            return self.fixed_tables
        if self.k >= len(locality.tables):
            return None
        return _top_k(cold_lookups_per_table(global_kjt, locality, world_size), locality.tables, self.k)

    def __repr__(self) -> str:
        return (f"TopKTablesAllocator(k={self.k}, tables={self.fixed_tables}, tie_break={self.tie_break!r}, "
                f"move_penalty={self.move_penalty})")


_ALLOCATORS: Dict[str, Callable[..., InputAllocator]] = {
    "identity": IdentityAllocator,
    "greedy": GreedyLocalityAllocator,
    "topk_tables": TopKTablesAllocator,
}


def build_allocator(name: str, **kw: Any) -> InputAllocator:
    """An allocator by name: ``identity``, ``greedy``, ``topk_tables`` (``k=``, optional ``tables=``)."""
    if name not in _ALLOCATORS:
        raise ValueError(f"unknown input allocator {name!r}; known: {sorted(_ALLOCATORS)}")
    return _ALLOCATORS[name](**kw)


# ---------------------------------------------------------------------------------------- metrics


def _check_assignment(rank_of_sample: torch.Tensor, num_samples: int, world_size: int) -> torch.Tensor:
    r = torch.as_tensor(rank_of_sample).to(torch.int64).flatten()
    if r.numel() != num_samples:
        raise ValueError(f"rank_of_sample has {r.numel()} entries for {num_samples} samples")
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= world_size):
        raise ValueError(f"rank_of_sample has ranks outside [0, {world_size})")
    return r


def _local_total(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int,
                 rank_of_sample: torch.Tensor) -> Tuple[int, int]:
    lk = _lookups(global_kjt, locality, world_size)
    r = _check_assignment(rank_of_sample, lk.num_samples, world_size)
    s = _score(lk, locality)
    local = int(s.gather(1, r.unsqueeze(1)).sum()) if lk.num_samples else 0
    return local, int(lk.ids.numel())


def local_lookup_share(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int,
                       rank_of_sample: torch.Tensor) -> float:
    """Share of all lookups of the batch that are local to the rank their sample is assigned to
    (1.0 for a batch without lookups)."""
    local, total = _local_total(global_kjt, locality, world_size, rank_of_sample)
    return local / total if total else 1.0


def remote_cold_lookups(global_kjt: KeyedJaggedTensor, locality: Locality, world_size: int,
                        rank_of_sample: torch.Tensor) -> int:
    """Lookups that must be served by another rank under the assignment: cold ids whose owner is not the
    sample's rank and which that rank does not cache (hot ids are always local)."""
    local, total = _local_total(global_kjt, locality, world_size, rank_of_sample)
    return total - local


def moved_samples(rank_of_sample: torch.Tensor, world_size: int) -> int:
    """Samples that leave their home rank ``s // B`` (each costs its dense features, ids and label
    in the sample exchange)."""
    r = torch.as_tensor(rank_of_sample).to(torch.int64).flatten()
    b = local_batch_size(r.numel(), world_size)
    home = torch.arange(r.numel()) // max(b, 1)
    return int((r != home).sum())
