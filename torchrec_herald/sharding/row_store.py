"""One rank's embedding rows, addressed by global key: P²RES's hot replicas (a dense TBE buffer + their
row-wise Adagrad state), this rank's ROW_WISE cold block (fbgemm's fused TBE) and Herald's cache of
remote rows; with the one exact update rule (EXACT_SGD / EXACT_ROWWISE_ADAGRAD, as the fused kernel).

Rows live on the training device; keys, slots and masks stay on CPU, and each access moves only its
slot indices over. On a CPU device, where ``make setup`` built herald's compiled extension, by-key reads
and writes run in one compiled pass (``native/row_store.cpp``); the torch ops here are the reference.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn

from torchrec_herald.keymap import SortedKeyMap
from torchrec_herald.layout import RowLayout
from torchrec_herald.native import load_if_built
from torchrec_herald.ops.tbe import dense_hot_tbe, fused_cold_tbe

__all__ = ["RowStore", "add_rows_in_order", "exact_update", "host_positions_to_device", "host_to_device"]


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (the host's: plan indices, masks) on the rows' ``device`` without the host waiting for the GPU. A
    copy to a GPU from pageable memory, blocking or not, may synchronise the stream, so the host would wait for
    every kernel queued before it; one from pinned memory is queued. So the index is staged in pinned memory
    first (the caching host allocator keeps that block until the copy is done). A no-op on a CPU."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_positions_to_device(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The positions where the host's bool ``mask`` is set, on ``device`` (:func:`host_to_device`): found on the
    host, since a boolean mask indexing on a GPU reads its count back (a sync)."""
    return host_to_device(mask.nonzero().squeeze(1), device)


def add_rows_in_order(total: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``total[index[i]] += src[i]`` for every ``i``, in place and in one op whatever the number of ranks ``src``
    gathers, deterministically: the same sums every run, and on every replica given the same ``src``. On a CPU
    ``index_add_`` adds serially, each row's additions in the order of ``src``. On a GPU ``index_add_`` adds by
    atomics, in no set order; ``index_put_(accumulate=True)`` sorts ``index`` and adds each row's run in sequence
    (the op torch's deterministic mode runs for ``index_add_``)."""
    if total.is_cuda:
        return total.index_put_((index,), src, accumulate=True)
    return total.index_add_(0, index, src)


def mean_square_by_lanes(grad: torch.Tensor) -> torch.Tensor:
    """Each row's mean of squares ``[n]``, summed in the order of fbgemm's CPU row-wise Adagrad kernel (its AVX2
    reduction, ``rowwise_sparse_adagrad_ref``): the squares into 8 lanes, element ``j`` into lane ``j % 8`` in order,
    then the lanes pairwise, ``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``, then a division by ``D``.
    ``grad.pow(2).mean(1)`` sums in another order, so an ulp of the state differed from the kernel's."""
    n, d = grad.shape
    sq = grad * grad
    if d % 8:
        sq = torch.cat([sq, sq.new_zeros(n, 8 - d % 8)], 1)
    chunks = sq.view(n, -1, 8)
    lanes = chunks[:, 0]
    for k in range(1, chunks.shape[1]):
        lanes = lanes + chunks[:, k]
    l = lanes.unbind(1)
    return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) / d


def exact_update(w: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, optimizer: EmbOptimType, lr: float,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels' update of rows ``w`` ``[n, D]`` with row-wise state ``state`` ``[n]`` and summed
    gradient ``grad``: EXACT_SGD ``w − lr·g``; EXACT_ROWWISE_ADAGRAD ``s + mean(g²)``, then
    ``w + g·(−lr/(sqrt(s) + eps))``, each step rounded as fbgemm's CPU kernel rounds it, bit for bit
    (:func:`mean_square_by_lanes`; the square root correctly rounded, which torch's vectorised float ``sqrt`` is not
    always; the step a division, where ``lr / t`` is torch's reciprocal times ``lr``). Returns the new
    ``(w, state)`` (the state unchanged for SGD). On a GPU, whose fused kernel reduces in another order still, the
    short form, with fewer launches (a GPU's step is its host's)."""
    if optimizer == EmbOptimType.EXACT_SGD:
        return w - lr * grad, state
    if grad.is_cuda:  # (a GPU's fused kernel sums its squares by warps, in neither order: the few launches, then)
        state = state + grad.pow(2).mean(1)
        return w - grad * (lr / (state.sqrt() + eps))[:, None], state
    state = state + mean_square_by_lanes(grad)
    step = torch.full_like(state, -lr) / (state.double().sqrt().to(state.dtype) + eps)
    return step[:, None] * grad + w, state


def exact_update_where_nonzero(w: torch.Tensor, state: torch.Tensor, grad: torch.Tensor, optimizer: EmbOptimType,
                               lr: float, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact_update` where a row's gradient is nonzero, the row as it was elsewhere (as the fused
    kernel leaves a row no batch read), with no host read (``eps = 0`` and a zero state would otherwise
    make such a row ``0·lr/0``, NaN). With SGD, or Adagrad with ``eps > 0``, a zero gradient already leaves
    its row's value as it was (``s + 0 = s``; ``w − 0·x = w`` for the finite ``x = lr/(sqrt(s) + eps)``), so
    no mask is made: four launches fewer a step on a GPU."""
    if optimizer == EmbOptimType.EXACT_SGD or eps > 0:
        return exact_update(w, state, grad, optimizer, lr, eps)
    nonzero = grad.ne(0).any(1)
    new_w, new_s = exact_update(w, state, grad, optimizer, lr, eps)
    return torch.where(nonzero[:, None], new_w, w), torch.where(nonzero, new_s, state)


class RowStore(nn.Module):
    """The rows one rank holds (see the module docstring).

    Args:
        layout: the global row space.
        rank: this rank.
        dim: embedding dimension of every table.
        fused_params: the embedding optimizer (``optimizer``, ``learning_rate``, ``eps``).
        device: where the rows live.
    """

    def __init__(self, layout: RowLayout, rank: int, dim: int, fused_params: Dict[str, Any],
                 device: torch.device) -> None:
        super().__init__()
        self.layout, self.rank, self.dim, self.device = layout, rank, dim, device
        self.optimizer: EmbOptimType = fused_params["optimizer"]
        self.adagrad = self.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
        self.lr = float(fused_params.get("learning_rate", 0.01))  # (set_learning_rate changes it)
        self.eps = float(fused_params.get("eps", 1e-8))
        self.block_rows: List[int] = layout.block_rows[rank].tolist()
        self.cold = fused_cold_tbe(sum(self.block_rows), dim, fused_params, device)
        self._cold_key: Optional[tuple] = None  # see _cold_views
        self._cold_cached: Tuple[torch.Tensor, Optional[torch.Tensor]] = (torch.empty(0), None)
        self.hot = dense_hot_tbe(layout.num_hot, dim, device)
        self.hot_state = torch.zeros(max(layout.num_hot, 1), dtype=torch.float32, device=device)
        mirror_hot, mirror_cold = layout.hot_rows_in_block(rank)
        self.mirror_hot, self.mirror_cold = mirror_hot.to(device), mirror_cold.to(device)
        # a hot replica was updated since the block copies were last written (see flush_mirror): one flag, not
        # one per row, so an update marks nothing on the device (a launch less a step on a GPU); the flush
        # then writes every copy, and the copies of rows not updated are rewritten with the values they hold
        self._mirror_stale = False
        # by-key access (plan mode only): own rows by arithmetic on the key, cached rows in a sorted map
        self.cache_map = SortedKeyMap(slot=torch.int64)
        # remote rows (Herald's cache): [slots, D] weights + [slots] state, grown on demand
        self.cache_w = torch.zeros(0, dim, device=device)
        self.cache_s = torch.zeros(0, device=device)
        self.free: List[int] = []
        # bounded staleness: each hot replica's / cache entry's value when it was last synced
        self.track_base = False
        self.base_hot = torch.zeros(0, dim + 1, device=device)  # (sized by rebase_hot when tracking starts: a
        # second copy of every hot row, which only bounded staleness needs, would double the hot rows' memory)
        self.base_cache = torch.zeros(0, dim + 1, device=device)
        self._zero = torch.zeros((), device=device)  # SGD's row-wise state, expanded (:meth:`_no_state`)
        # by-key reads and writes in one compiled pass (CPU rows, the extension built), else torch ops; where
        # each key's row is (hot, own block or cache slot) is found by the compiled pass wherever the keys are
        # on the CPU, the rows anywhere: the plan's keys are the host's (its scheduler's) even for GPU rows.
        # The plan executor's other passes over the host's plan (a plan's route, the merged pushes) use it too
        self.native: Optional[Any] = load_if_built() if torch.device(device).type == "cpu" else None
        self.native_locate: Optional[Any] = load_if_built()

    # ------------------------------------------------------------------ views

    def set_learning_rate(self, lr: float, own_updates: bool = True) -> None:
        """The embedding optimizer's learning rate from now on: the cold TBE's fused update (as TorchRec's
        fused optimizer sets it) and, with ``own_updates``, every update herald applies itself (hot rows, the
        plan's reduces)."""
        self.cold.set_learning_rate(float(lr))
        if own_updates:
            self.lr = float(lr)
    def hot_weights(self) -> torch.Tensor:
        """``[max(num_hot, 1), D]`` view of the hot replica buffer."""
        return self.hot.weights.detach().view(-1, self.dim)

    def _cold_views(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The cold TBE's weight and row-wise state views, made once: fbgemm's ``split_*`` accessors cost
        6–11 µs of Python a call and the executor reads them several times a step. They are made again
        where the TBE's buffers moved (a new TBE, a buffer replaced by a load)."""
        tbe = self.cold
        bufs = [tbe.weights_dev, tbe.weights_host, tbe.weights_uvm]
        if self.adagrad:
            bufs += [tbe.momentum1_dev, tbe.momentum1_host, tbe.momentum1_uvm]
        key = tuple((id(b), b.data_ptr()) for b in bufs)
        if self._cold_key != key:
            w = tbe.split_embedding_weights()[0].data
            s = tbe.split_optimizer_states()[0][0].view(-1).data if self.adagrad else None
            self._cold_key, self._cold_cached = key, (w, s)
        return self._cold_cached

    def cold_weights(self) -> torch.Tensor:
        """``[block rows, D]`` view of this rank's cold block (the fused TBE's weights)."""
        return self._cold_views()[0]

    def cold_state(self) -> Optional[torch.Tensor]:
        """``[block rows]`` view of the cold block's row-wise Adagrad state, or None (SGD)."""
        return self._cold_views()[1]

    def cold_block(self, table: int) -> torch.Tensor:
        """This rank's block of ``table`` (a view into the cold TBE), its hot rows' copies up to date."""
        self.flush_mirror()
        start = sum(self.block_rows[:table])
        return self.cold.split_embedding_weights()[0][start: start + self.block_rows[table]]

    def cold_block_state(self, table: int) -> Optional[torch.Tensor]:
        """The row-wise Adagrad state of :meth:`cold_block`, or None."""
        self.flush_mirror()
        state = self.cold_state()
        start = sum(self.block_rows[:table])
        return None if state is None else state[start: start + self.block_rows[table]]

    def hot_block(self, table: int) -> torch.Tensor:
        """The hot replicas of ``table`` (a view into the hot buffer)."""
        start = sum(self.layout.hot_counts[:table])
        return self.hot_weights()[start: start + self.layout.hot_counts[table]]

    def mirror_hot_into_cold(self) -> None:
        """Copy the replicas of the hot rows that lie in this rank's block (weights and state) into the cold
        TBE, so the block is always a complete ROW_WISE shard. Writes ``.data``: it runs inside backward,
        where the cold TBE's saved tensors must not see a version bump (the rows written are hot, never
        looked up or updated through the cold TBE)."""
        self._mirror_stale = False  # every copy is written now
        hot, cold = self.mirror_hot, self.mirror_cold
        if not hot.numel():
            return
        self.cold_weights()[cold] = self.hot_weights()[hot]
        state = self.cold_state()
        if state is not None:
            state[cold] = self.hot_state[hot]

    def flush_mirror(self) -> None:
        """Write the block copies of the hot rows updated since the last flush. Nothing looks a hot row up
        in the cold TBE, so the copies are needed only where the block is read as a ROW_WISE shard
        (:meth:`cold_block`, :meth:`cold_block_state`: state dicts, checkpoints, full tables); writing
        them there, not at every update, takes two index copies off each step."""
        if self._mirror_stale:
            self.mirror_hot_into_cold()

    def update_hot_rows(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply :func:`exact_update` to the hot replicas ``rows`` (distinct hot slots, on the device) with
        ``grad`` ``[len(rows), D]`` their gradient summed over ranks; the block copies follow at the next
        :meth:`flush_mirror`. A row whose gradient is zero is left as it is (as the fused kernel
        leaves a row no batch read): on a CPU only the others are touched (fewer rows to write); on a GPU
        every row is written, each keeping its old value where its gradient is zero
        (:func:`exact_update_where_nonzero`), since picking the rows out is sized by the data and would
        make the host wait."""
        with torch.no_grad():
            update = exact_update_where_nonzero
            if not rows.is_cuda:
                nonzero = grad.ne(0).any(1)
                rows, grad, update = rows[nonzero], grad[nonzero], exact_update
                if not rows.numel():
                    return
            w, s = self.hot_weights(), self.hot_state
            w[rows], s[rows] = update(w[rows], s[rows], grad, self.optimizer, self.lr, self.eps)
            self._mirror_stale = True

    # ------------------------------------------------------------------ by global key
    def _no_state(self, n: int) -> torch.Tensor:
        """SGD's row-wise state of ``n`` rows (zeros, never written): a view of one 0-d zero, no kernel (a launch
        each on a GPU)."""
        return self._zero.expand(n)

    def _dev(self, index: torch.Tensor) -> torch.Tensor:
        return host_to_device(index, self.device)

    def _positions(self, mask: torch.Tensor) -> torch.Tensor:
        return host_positions_to_device(mask, self.device)

    def _where(self, keys: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Masks of ``keys`` held as hot replica / own block row / cache entry (a key must be one), and
        each key's hot slot, own block row and cache slot (-1 where not; with the compiled access, -1 also
        for the block row of a hot key, which no caller reads)."""
        if self._locates(keys):
            kind, slot = self._kinds(keys)
            hot, own, cache = kind == 0, kind == 1, kind == 2
            none = torch.full_like(slot, -1)
            return hot, own, cache, torch.where(hot, slot, none), torch.where(own, slot, none), torch.where(cache, slot, none)
        hot_slot = self.layout.hot_slot(keys)
        own_slot = self.own_slot(keys)
        cache_slot = self.cache_slot(keys)
        hot = hot_slot >= 0
        own = ~hot & (own_slot >= 0)
        cache = ~hot & ~own
        if bool(cache.any()) and bool((cache_slot[cache] < 0).any()):
            raise self._not_held(keys, (cache & (cache_slot < 0)).nonzero().flatten())
        return hot, own, cache, hot_slot, own_slot, cache_slot

    def own_slot(self, keys: torch.Tensor) -> torch.Tensor:
        """int64: each key's row in this rank's cold block, -1 elsewhere."""
        return self.layout.block_slot(keys, self.rank)

    def cache_slot(self, keys: torch.Tensor) -> torch.Tensor:
        """int64: each key's cache slot, -1 when not cached."""
        return self.cache_map.get(keys, "slot")

    def _kinds(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each key's kind of row (0 hot replica, 1 own block row, 2 cache entry) and its slot there, on the
        host; a key held nowhere raises."""
        if self._locates(keys):
            kind, slot = self._locate(keys)
            if kind.numel() and int(kind.min()) < 0:
                raise self._not_held(keys, (kind < 0).nonzero().flatten())
            return kind, slot
        hot, own, _, hot_slot, own_slot, cache_slot = self._where(keys)
        kind = torch.where(hot, 0, torch.where(own, 1, 2))
        return kind, torch.where(hot, hot_slot, torch.where(own, own_slot, cache_slot))

    def _slots(self, keys: torch.Tensor) -> List[Tuple[int, Optional[torch.Tensor], torch.Tensor]]:
        """Per kind of row holding any of ``keys`` (0 hot, 1 own block, 2 cache): the keys' positions and
        their slots, on the device. A kind absent from ``keys`` is left out, and where one kind holds every
        key its positions are None (the keys' own order): at one rank every key is the rank's own, and a
        read is then one gather a buffer. All the indices reach the device in one copy (each copy from
        host memory is a synchronous transfer on a GPU). Where the compiled access is built, one counting
        pass groups them (``row_store_slots``); the torch ops below are its reference."""
        n = keys.numel()
        if not n:
            return []
        if self._locates(keys):
            counts_by_kind, flat, missing = self.native_locate.row_store_slots(keys.to(torch.int64).contiguous(),
                                                                               *self._native_args())
            if missing >= 0:  # (the locate names every key not held)
                raise self._not_held(keys, (self._locate(keys)[0] < 0).nonzero().flatten())
            counts = counts_by_kind.tolist()
            slot = flat[n:]
        else:
            kind, slot = self._kinds(keys)
            counts = torch.bincount(kind, minlength=3).tolist()
            flat = None
        whole = [k for k in range(3) if counts[k] == n]
        if whole:  # (the compiled pass's positions are then 0…n−1 and its slots in the keys' order)
            return [(whole[0], None, self._dev(slot))]
        if flat is None:
            order = torch.sort(kind, stable=True)[1]
            flat = torch.cat([order, slot[order]])
        flat = self._dev(flat)
        pos, slots = flat[:n].split(counts), flat[n:].split(counts)
        return [(k, pos[k], slots[k]) for k in range(3) if counts[k]]

    def _rows_by_kind(self) -> Tuple[Tuple[torch.Tensor, ...], Optional[Tuple[torch.Tensor, ...]]]:
        """The hot, own-block and cache rows, and their row-wise Adagrad states (None for SGD), by kind."""
        cold_s = self.cold_state()
        w = (self.hot_weights(), self.cold_weights(), self.cache_w)
        return w, (None if cold_s is None else (self.hot_state, cold_s, self.cache_s))

    def _locates(self, keys: torch.Tensor) -> bool:
        """Whether the compiled pass finds where ``keys`` live (built, and the keys on the host)."""
        return self.native_locate is not None and keys.device.type == "cpu"

    def _locate(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each key's kind (0 hot replica, 1 own block row, 2 cache entry, -1 not held) and slot, by the
        compiled pass."""
        assert self.native_locate is not None
        return self.native_locate.row_store_locate(keys.to(torch.int64).contiguous(), *self._native_args())

    def _native_args(self) -> Tuple[Any, ...]:
        """Where rows live, for the compiled access: hot keys, table offsets, block sizes, this rank's block
        offsets, the rank, the cache's keys and slots."""
        L = self.layout
        return (L.hot_keys, L.table_offsets, L.blocks, L.block_offsets[self.rank].contiguous(), self.rank,
                self.cache_map.keys, self.cache_map.col("slot"))

    def _native_buffers(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The hot, own-block and cache rows, and their row-wise Adagrad states (none for SGD)."""
        w, s = self._rows_by_kind()
        return list(w), ([] if s is None else list(s))

    def _not_held(self, keys: torch.Tensor, missing: torch.Tensor) -> RuntimeError:
        return RuntimeError(f"rank {self.rank}: plan reads rows it does not hold: keys {keys[missing][:5].tolist()}")

    def read(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(weights [n, D], row-wise Adagrad state [n])`` of rows this rank holds."""
        if self.native is not None:
            keys = keys.to(torch.int64).contiguous()
            w, s, missing = self.native.row_store_gather(keys, *self._native_args(), *self._native_buffers(), self.dim)
            if missing.numel():
                raise self._not_held(keys, missing)
            return w, s
        groups = self._slots(keys)
        bufs_w, bufs_s = self._rows_by_kind()
        if len(groups) == 1 and groups[0][1] is None:  # one kind of row, in the keys' order: no scatter
            kind, _, slot = groups[0]
            s = bufs_s[kind][slot] if bufs_s is not None else self._no_state(keys.numel())
            return bufs_w[kind][slot], s
        # (every key is held by one kind: each position is written below)
        w = torch.empty(keys.numel(), self.dim, device=self.device)
        s = torch.empty(keys.numel(), device=self.device) if bufs_s is not None else self._no_state(keys.numel())
        for kind, pos, slot in groups:
            w[pos] = bufs_w[kind][slot]
            if bufs_s is not None:
                s[pos] = bufs_s[kind][slot]
        return w, s

    def write(self, keys: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
        """Store rows (a remote row gets a cache slot)."""
        if self.native is not None:
            keys, w, s = keys.to(torch.int64).contiguous(), w.contiguous(), s.contiguous()
            self._store_giving_slots(lambda k, w, s: self.native.row_store_scatter(
                k, *self._native_args(), w, s, *self._native_buffers(), self.dim), keys, w, s)
            return
        self._allocate(keys)
        groups = self._slots(keys)
        bufs_w, bufs_s = self._rows_by_kind()  # after _allocate: giving slots may grow the cache
        for kind, pos, slot in groups:
            bufs_w[kind][slot] = w if pos is None else w[pos]
            if bufs_s is not None:
                bufs_s[kind][slot] = s if pos is None else s[pos]

    def apply_gradient(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply :func:`exact_update` to the rows of ``keys`` (distinct, held here) with ``grad`` their summed
        gradient: a :meth:`read` and a :meth:`write`, the keys' rows found once on the torch path."""
        if self.native is not None:
            w, s = self.read(keys)
            self.write(keys, *exact_update(w, s, grad, self.optimizer, self.lr, self.eps))
            return
        bufs_w, bufs_s = self._rows_by_kind()
        groups = self._slots(keys)
        if not groups:
            return
        # the rows of every kind updated together (one update's ops, not one a kind of row), then put back
        def joined(parts: List[torch.Tensor]) -> torch.Tensor:
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        pos = [p for _, p, _ in groups]
        w = joined([bufs_w[kind][slot] for kind, _, slot in groups])
        s = (joined([bufs_s[kind][slot] for kind, _, slot in groups]) if bufs_s is not None
             else self._no_state(keys.numel()))
        g = grad if pos[0] is None else grad[joined(pos)]  # (one group in the keys' order: as they are)
        new_w, new_s = exact_update(w, s, g, self.optimizer, self.lr, self.eps)
        sizes = [slot.numel() for _, _, slot in groups]
        for (kind, _, slot), kw, ks in zip(groups, new_w.split(sizes), new_s.split(sizes)):
            bufs_w[kind][slot] = kw
            if bufs_s is not None:
                bufs_s[kind][slot] = ks

    def _store_giving_slots(self, store: Callable[..., torch.Tensor], keys: torch.Tensor,
                            *per_key: torch.Tensor) -> None:
        """A compiled store of ``keys`` and their rows ``per_key``, ``store(keys, *per_key)`` returning the
        positions this rank does not hold: those (remote rows not cached yet) get cache slots, then are
        stored. ``store`` reads the buffers at each call (giving slots may grow the cache)."""
        missing = store(keys, *per_key)
        if missing.numel():
            new = keys[missing]
            self._give_slots(new)
            missing = store(new, *(t[missing] for t in per_key))
            assert not missing.numel(), "every key has a slot after _give_slots"

    def reserve(self, keys: torch.Tensor) -> None:
        """Give the remote keys among ``keys`` (unique) that this rank does not hold yet a cache slot now,
        before their rows arrive: storing them (:meth:`receive`) is then one pass. Only where the compiled
        access is built (the torch reference gives slots as it stores)."""
        if self.native is None or not keys.numel():
            return
        self._allocate(keys)

    def _allocate(self, keys: torch.Tensor) -> None:
        """Give remote keys without a cache slot one (growing the cache when no slot is free)."""
        if self._locates(keys):  # held nowhere: kind < 0
            self._give_slots(keys[self._locate(keys)[0] < 0])
            return
        self._give_slots(keys[(self.layout.hot_slot(keys) < 0) & (self.own_slot(keys) < 0) & ~self.cache_map.contains(keys)])

    def _give_slots(self, new: torch.Tensor) -> None:
        """Give the remote keys ``new`` (unique, none cached) cache slots, growing the cache when none is free."""
        if not new.numel():
            return
        short = new.numel() - len(self.free)
        if short > 0:
            start = self.cache_w.shape[0]
            grow = max(short, start // 2, 64)
            self.cache_w = torch.cat([self.cache_w, torch.zeros(grow, self.dim, device=self.device)])
            self.cache_s = torch.cat([self.cache_s, torch.zeros(grow, device=self.device)])
            self.base_cache = torch.cat([self.base_cache, torch.zeros(grow, self.dim + 1, device=self.device)])
            self.free.extend(range(start + grow - 1, start - 1, -1))
        n = new.numel()
        slots = self.free[-n:][::-1]  # the last n free slots, last first (as n pops of the stack)
        del self.free[-n:]
        new, order = torch.sort(new)  # (the plan's keys are unique)
        self.cache_map.insert(new, slot=torch.tensor(slots, dtype=torch.int64)[order])

    def drop(self, keys: torch.Tensor) -> None:
        """Free the cache slots of ``keys``."""
        pos, found = self.cache_map.find(keys)
        pos = pos[found]
        self.free.extend(self.cache_map.col("slot")[pos].tolist())
        self.cache_map.remove_at(pos)

    def drop_cache(self) -> None:
        """Forget every cache entry and release the cache buffers."""
        self.cache_w = torch.zeros(0, self.dim, device=self.device)
        self.cache_s = torch.zeros(0, device=self.device)
        self.free = []
        self.cache_map.clear()
        self.base_cache = torch.zeros(0, self.dim + 1, device=self.device)

    # ------------------------------------------------------------------ bounded staleness: sync bases
    def _size_base_hot(self) -> None:
        """The hot replicas' bases, made at the first use (bounded staleness only)."""
        if self.base_hot.shape[0] != self.layout.num_hot:
            self.base_hot = torch.zeros(self.layout.num_hot, self.dim + 1, device=self.device)

    def _native_bases(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.base_hot, self.base_cache  # (no hot bases before tracking: a push without add reads none)

    def rebase(self, keys: torch.Tensor) -> None:
        """Base of the hot replicas / cache entries among ``keys`` := their current value (+ state)."""
        self._size_base_hot()
        if self.native is not None:
            keys = keys.to(torch.int64).contiguous()
            missing = self.native.row_store_rebase(keys, *self._native_args(), *self._native_buffers(),
                                                   *self._native_bases(), self.dim)
            if missing.numel():
                raise self._not_held(keys, missing)
            return
        hot, _, cache, hot_slot, _, cache_slot = self._where(keys)
        w, st = self.read(keys)
        val = torch.cat([w, st[:, None]], 1)
        d = self._dev
        self.base_hot[d(hot_slot[hot])] = val[self._positions(hot)]
        self.base_cache[d(cache_slot[cache])] = val[self._positions(cache)]

    def rebase_hot(self) -> None:
        """Every hot replica's base := its current value (every replica is in sync with its home)."""
        self._size_base_hot()
        n = self.base_hot.shape[0]
        self.base_hot[:, : self.dim] = self.hot_weights()[:n]
        self.base_hot[:, self.dim] = self.hot_state[:n]

    def receive(self, keys: torch.Tensor, rows: torch.Tensor, add: torch.Tensor) -> None:
        """Store the rows one source sent (``rows`` ``[n, D (+ 1 Adagrad state)]``): where ``add`` add them
        to the row held (an accumulated update), else replace it (a remote row gets a cache slot); with
        :attr:`track_base` the hot replicas and cache entries among them are rebased."""
        if self.native is not None:
            def store(k: torch.Tensor, r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
                missing = self.native.row_store_receive(k, *self._native_args(), r, a, *self._native_buffers(),
                                                        *self._native_bases(), self.track_base, self.dim)
                if bool(a[missing].any()):  # an added update needs the row held (only pulls bring new rows)
                    raise self._not_held(k, missing[a[missing]])
                return missing

            self._store_giving_slots(store, keys.to(torch.int64).contiguous(), rows.contiguous(), add.contiguous())
            return
        # (written as they are where nothing adds: the store copies them into its buffers)
        w, st = rows[:, : self.dim], rows[:, self.dim] if self.adagrad else self._no_state(keys.numel())
        if bool(add.any()):
            w, st = w.clone(), st.clone()
            cur_w, cur_s = self.read(keys[add])
            a_d = self._positions(add)
            w[a_d] += cur_w
            st[a_d] += cur_s
        self.write(keys, w, st)
        if self.track_base:
            self.rebase(keys)

    def payload(self, keys: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """``[n, D + 1]``: each row's value and state (0 for SGD), minus its base where ``add`` (the copy's
        accumulated update, which its home adds)."""
        if self.native is not None:
            keys, add = keys.to(torch.int64).contiguous(), add.contiguous()
            out, missing, own = self.native.row_store_payload(keys, *self._native_args(), add, *self._native_buffers(),
                                                              *self._native_bases(), self.dim)
            if missing.numel():
                raise self._not_held(keys, missing)
            if own.numel():
                raise self._own_push(keys[own])
            return out
        w, st = self.read(keys)
        rows = torch.cat([w, st[:, None]], 1)
        if bool(add.any()):
            rows[self._positions(add)] -= self.base(keys[add])
        return rows

    def _own_push(self, keys: torch.Tensor) -> RuntimeError:
        return RuntimeError(f"rank {self.rank}: a home never pushes its own rows (keys {keys[:5].tolist()})")

    def base(self, keys: torch.Tensor) -> torch.Tensor:
        """``[n, D + 1]`` bases of hot replicas / cache entries (a home never pushes its own rows)."""
        hot, own, cache, hot_slot, _, cache_slot = self._where(keys)
        if bool(own.any()):
            raise self._own_push(keys[own])
        d = self._dev
        out = torch.empty(keys.numel(), self.dim + 1, device=self.device)
        self._size_base_hot()
        out[self._positions(hot)] = self.base_hot[d(hot_slot[hot])]
        out[self._positions(cache)] = self.base_cache[d(cache_slot[cache])]
        return out
