"""Executes Herald's communication plan on one rank (DESIGN §3, Herald (b)): worker caches of remote rows,
pulls of missing/outdated rows, gradient reduce at one reducer per row, lazy pushes home.

In plan mode (driven by :class:`~torchrec_herald.pipeline.HeraldTrainPipeline`) every row a rank reads is
local when its forward runs: a hot replica, a row of its own ROW_WISE block, or a cache entry, pulled
before the forward when the plan says so. Backward yields the gradient of each row read; rows read by
several ranks have their gradients summed at the plan's reducer, which applies the **one** exact update
(EXACT_SGD or EXACT_ROWWISE_ADAGRAD: the fused kernel's rule, as herald's hot replicas do). A transfer
carries the row's current value and, for row-wise Adagrad, its state: what the merged pending updates add
up to, bit for bit, without re-summing deltas. The plan is known to every rank, so no ids travel.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_herald.pipeline.lazy_sync import ExecPlan, FlushPlan
from torchrec_herald.comm import all_to_all_rows

if TYPE_CHECKING:
    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

logger = logging.getLogger(__name__)


class PlanExecutor:
    """The rows one rank holds in plan mode and the transfers of each step's :class:`ExecPlan`.

    Storage: hot replicas and the rank's cold blocks stay where the herald EBC keeps them (dense hot
    buffer + its row-wise Adagrad state, fused cold TBE weights + momentum); remote rows live in a cache
    (``[slots, D]`` weights + ``[slots]`` state) that grows on demand and whose slots the plan's
    evictions free (the plan bounds the entries per table). Rows live on the EBC's device (CUDA or
    CPU); keys, slots and plans stay on CPU, and each access moves only its slot indices over.
    """

    def __init__(self, ebc: "ShardedHeraldEmbeddingBagCollection") -> None:
        self.ebc = ebc
        self.W, self.rank, self.D = ebc._world, ebc._rank, ebc._dim
        self.pg = ebc._pg
        self.dev = ebc._device
        self.adagrad = ebc._optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
        self.lr = float(ebc._fused_params["learning_rate"])
        self.eps = float(ebc._fused_params.get("eps", 1e-8))
        n = torch.tensor(ebc._num_embeddings, dtype=torch.int64)
        self.num_rows = int(n.sum())
        self.table_of = torch.repeat_interleave(torch.arange(len(n)), n)
        local_id = torch.arange(self.num_rows) - ebc._table_offsets[self.table_of]
        blocks = torch.tensor(ebc._blocks, dtype=torch.int64)[self.table_of]
        self.home = local_id // blocks
        # own block slot of every key this rank is home of (fused cold TBE row), else -1
        self.own_slot = torch.full((self.num_rows,), -1, dtype=torch.int64)
        mine = self.home == self.rank
        self.own_slot[mine] = (ebc._owner_table_offset[self.rank, self.table_of[mine]]
                               + local_id[mine] - self.rank * blocks[mine])
        self.hot_slot = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self.hot_slot[ebc._hot_keys] = torch.arange(ebc._num_hot)
        self.cache_slot = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self.cache_w = torch.zeros(0, self.D, device=self.dev)
        self.cache_s = torch.zeros(0, device=self.dev)
        self.free: List[int] = []
        self.width = self.D + (1 if self.adagrad else 0)  # floats per transferred row
        # bounded staleness: the value each hot replica / cache entry was last synced at (its accumulated
        # update is the copy minus this base); kept only when a plan can push additively
        self.track_base = False
        self.base_hot = torch.zeros(ebc._num_hot, self.D + 1, device=self.dev)
        self.base_cache = torch.zeros(0, self.D + 1, device=self.dev)

    # ------------------------------------------------------------------ storage
    def _on_dev(self, index: torch.Tensor) -> torch.Tensor:
        """A CPU index or mask, where the rows are."""
        return index.to(self.dev, non_blocking=True)

    def _stores(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        ebc = self.ebc
        hot_w = ebc._hot.weights.detach().view(-1, self.D)
        cold_w = ebc._cold.split_embedding_weights()[0].data
        cold_s = ebc._cold_momentum()
        return hot_w, cold_w, (cold_s.data if cold_s is not None else None), ebc._hot_state

    def _where(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Masks of ``keys`` held as hot replica / own block row / cache entry (a key must be one)."""
        hot = self.hot_slot[keys] >= 0
        own = ~hot & (self.own_slot[keys] >= 0)
        cache = ~hot & ~own
        if bool(cache.any()) and bool((self.cache_slot[keys[cache]] < 0).any()):
            missing = keys[cache][self.cache_slot[keys[cache]] < 0][:5].tolist()
            raise RuntimeError(f"rank {self.rank}: plan reads rows it does not hold: keys {missing}")
        return hot, own, cache

    def read(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(weights [n, D], row-wise Adagrad state [n])`` of rows this rank holds."""
        hot_w, cold_w, cold_s, hot_s = self._stores()
        hot, own, cache = self._where(keys)
        d = self._on_dev
        w = torch.empty(keys.numel(), self.D, device=self.dev)
        s = torch.zeros(keys.numel(), device=self.dev)
        at_hot, at_own, at_cache = d(hot.nonzero().flatten()), d(own.nonzero().flatten()), d(cache.nonzero().flatten())
        hot_i, own_i, cache_i = (d(self.hot_slot[keys[hot]]), d(self.own_slot[keys[own]]),
                                 d(self.cache_slot[keys[cache]]))
        w[at_hot] = hot_w[hot_i]
        w[at_own] = cold_w[own_i]
        w[at_cache] = self.cache_w[cache_i]
        if self.adagrad:
            s[at_hot] = hot_s[hot_i]
            assert cold_s is not None
            s[at_own] = cold_s[own_i]
            s[at_cache] = self.cache_s[cache_i]
        return w, s

    def _allocate(self, keys: torch.Tensor) -> None:
        """Give remote keys without a cache slot one (growing the cache when no slot is free)."""
        new = keys[(self.hot_slot[keys] < 0) & (self.own_slot[keys] < 0) & (self.cache_slot[keys] < 0)]
        if not new.numel():
            return
        short = new.numel() - len(self.free)
        if short > 0:
            start = self.cache_w.shape[0]
            grow = max(short, start // 2, 64)
            self.cache_w = torch.cat([self.cache_w, torch.zeros(grow, self.D, device=self.dev)])
            self.cache_s = torch.cat([self.cache_s, torch.zeros(grow, device=self.dev)])
            self.base_cache = torch.cat([self.base_cache, torch.zeros(grow, self.D + 1, device=self.dev)])
            self.free.extend(range(start + grow - 1, start - 1, -1))
        slots = [self.free.pop() for _ in range(new.numel())]
        self.cache_slot[new] = torch.tensor(slots, dtype=torch.int64)

    def write(self, keys: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
        """Store rows (a remote row gets a cache slot)."""
        self._allocate(keys)
        hot_w, cold_w, cold_s, hot_s = self._stores()
        hot, own, cache = self._where(keys)
        d = self._on_dev
        at_hot, at_own, at_cache = d(hot.nonzero().flatten()), d(own.nonzero().flatten()), d(cache.nonzero().flatten())
        hot_i, own_i, cache_i = (d(self.hot_slot[keys[hot]]), d(self.own_slot[keys[own]]),
                                 d(self.cache_slot[keys[cache]]))
        hot_w[hot_i] = w[at_hot]
        cold_w[own_i] = w[at_own]
        self.cache_w[cache_i] = w[at_cache]
        if self.adagrad:
            assert cold_s is not None
            hot_s[hot_i] = s[at_hot]
            cold_s[own_i] = s[at_own]
            self.cache_s[cache_i] = s[at_cache]

    def drop(self, keys: torch.Tensor) -> None:
        """Free the cache slots of ``keys``."""
        keys = keys[self.cache_slot[keys] >= 0]
        self.free.extend(self.cache_slot[keys].tolist())
        self.cache_slot[keys] = -1

    def _rebase(self, keys: torch.Tensor) -> None:
        """Base of the hot replicas / cache entries among ``keys`` := their current value."""
        hot, own, cache = self._where(keys)
        w, st = self.read(keys)
        val = torch.cat([w, st[:, None]], 1)
        d = self._on_dev
        self.base_hot[d(self.hot_slot[keys[hot]])] = val[d(hot)]
        self.base_cache[d(self.cache_slot[keys[cache]])] = val[d(cache)]

    def _rebase_hot(self) -> None:
        hot_w, _, _, hot_s = self._stores()
        n = self.base_hot.shape[0]
        self.base_hot[:, : self.D] = hot_w[:n]
        self.base_hot[:, self.D] = hot_s[:n]

    def _base(self, keys: torch.Tensor) -> torch.Tensor:
        hot, own, cache = self._where(keys)
        if bool(own.any()):
            raise RuntimeError(f"rank {self.rank}: a home never pushes its own rows (keys {keys[own][:5].tolist()})")
        d = self._on_dev
        out = torch.empty(keys.numel(), self.D + 1, device=self.dev)
        out[d(hot)] = self.base_hot[d(self.hot_slot[keys[hot]])]
        out[d(cache)] = self.base_cache[d(self.cache_slot[keys[cache]])]
        return out

    # ------------------------------------------------------------------ transfers
    def _exchange(self, transfers: torch.Tensor, payload: Callable[[torch.Tensor], torch.Tensor], label: str,
                  width: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """One all-to-all of the rows of ``transfers`` (``(key, src, dst)``, known to every rank): for each
        destination this rank sends ``payload(i)``, ``i`` the positions in ``transfers`` of its rows to
        it; returns (per source, the positions of the rows received from it; the received rows)."""
        me, W = self.rank, self.W
        src, dst = transfers[:, 1], transfers[:, 2]
        send_pos = [((src == me) & (dst == d)).nonzero().squeeze(1) for d in range(W)]
        recv_pos = [((src == r) & (dst == me)).nonzero().squeeze(1) for r in range(W)]
        send = torch.cat([payload(i) for i in send_pos]) if any(i.numel() for i in send_pos) \
            else torch.zeros(0, width, device=self.dev)
        out = all_to_all_rows(send, [i.numel() for i in send_pos], [i.numel() for i in recv_pos], self.pg, label, width)
        return recv_pos, out

    def _row_payload(self, keys: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """Each row's value (+ Adagrad state); for ``add`` rows the accumulated update (value − base)."""
        w, st = self.read(keys)
        rows = torch.cat([w, st[:, None]], 1)
        if bool(add.any()):
            rows[self._on_dev(add)] -= self._base(keys[add])
        return rows if self.adagrad else rows[:, : self.D]

    def move_rows(self, transfers: torch.Tensor, label: str, add: Optional[torch.Tensor] = None) -> None:
        """One all-to-all for the ``(key, src, dst)`` rows of ``transfers`` (known to every rank): src sends
        the row's current value (+ state), dst stores it — or, where ``add`` is set, src sends its
        accumulated update and dst adds it. Sources are applied in rank order (a row's one replacing
        push comes from the lowest pushing rank, as the staleness planner assigns it)."""
        if not transfers.numel():
            return
        keys = transfers[:, 0]
        add = add if add is not None else torch.zeros(len(transfers), dtype=torch.bool)
        recv_pos, out = self._exchange(transfers, lambda i: self._row_payload(keys[i], add[i]), label, self.width)
        if self.track_base:  # what this rank pushed is now part of the home's copy
            sent = keys[transfers[:, 1] == self.rank]
            if sent.numel():
                self._rebase(sent)
        for pos, rows in zip(recv_pos, out.split([i.numel() for i in recv_pos])):
            if not rows.numel():
                continue
            k, a = keys[pos], add[pos]
            state = rows[:, self.D] if self.adagrad else torch.zeros(k.numel(), device=self.dev)
            w, st = rows[:, : self.D].clone(), state.clone()
            if bool(a.any()):
                cur_w, cur_s = self.read(k[a])
                a_d = self._on_dev(a)
                w[a_d] += cur_w
                st[a_d] += cur_s
            self.write(k, w, st)
            if self.track_base:
                self._rebase(k)

    def before_forward(self, plan: ExecPlan) -> None:
        """Pushes planned before the reads, then pulls of missing/outdated rows."""
        if hasattr(plan, "update_push_add") and not self.track_base:
            self.track_base = True
            self._rebase_hot()  # every replica is in sync with its home when a staleness run starts
        self.move_rows(plan.push_before_read, "herald_update_push", getattr(plan, "push_before_read_add", None))
        self.move_rows(plan.pull, "herald_pull")

    def after_backward(self, plan: ExecPlan, ws_keys: torch.Tensor, ws_grad: torch.Tensor) -> None:
        """Sum each read row's gradients at its reducer, apply the one exact update there, push dirty
        rows home for the next step's readers and on eviction, free evicted cache slots."""
        me = self.rank
        mine = plan.reducer == me
        upd = plan.update_keys[mine]
        d = self._on_dev
        total = torch.zeros(upd.numel(), self.D, device=self.dev)
        red_keys = plan.reduce[:, 0]
        recv_keys: List[torch.Tensor] = [red_keys[:0]] * self.W
        rows = torch.zeros(0, self.D, device=self.dev)
        if plan.reduce.numel():
            recv_pos, rows = self._exchange(plan.reduce,
                                            lambda i: ws_grad[d(torch.searchsorted(ws_keys, red_keys[i]))],
                                            "herald_reduce", self.D)
            recv_keys = [red_keys[i] for i in recv_pos]
        parts = rows.split([k.numel() for k in recv_keys])
        for src in range(self.W):  # gradients summed in rank order: deterministic
            if src == me:
                pos = torch.searchsorted(ws_keys, upd).clamp(max=max(ws_keys.numel() - 1, 0))
                read = ws_keys[pos] == upd if ws_keys.numel() else torch.zeros_like(upd, dtype=torch.bool)
                total[d(read)] += ws_grad[d(pos[read])]
            elif recv_keys[src].numel():
                total.index_add_(0, d(torch.searchsorted(upd, recv_keys[src])), parts[src])
        if upd.numel():
            w, s = self.read(upd)
            if self.adagrad:
                s = s + total.pow(2).mean(1)
                w = w - total * (self.lr / (s.sqrt() + self.eps))[:, None]
            else:
                w = w - self.lr * total
            self.write(upd, w, s)
        if self.track_base:  # additive pushes: in the planner's order (update pushes, then evictions)
            self.move_rows(plan.update_push, "herald_update_push", plan.update_push_add)  # type: ignore[attr-defined]
            self.move_rows(plan.miss_push, "herald_update_push", plan.miss_push_add)  # type: ignore[attr-defined]
        else:  # exact plan: every push replaces, disjoint rows: one all-to-all
            self.move_rows(torch.cat([plan.update_push, plan.miss_push]), "herald_update_push")
        self.drop(plan.evictions[me])

    def flush(self, fp: FlushPlan) -> None:
        """Dirty rows home, outdated hot replicas refreshed, caches dropped, home replicas mirrored into
        the cold blocks: the stock herald layout again (eval, checkpoints, a stock pipeline)."""
        self.move_rows(fp.push, "herald_update_push", getattr(fp, "push_add", None))
        self.move_rows(fp.pull, "herald_pull")
        self.drop(fp.dropped[self.rank])
        self.cache_w = torch.zeros(0, self.D, device=self.dev)
        self.cache_s = torch.zeros(0, device=self.dev)
        self.free = []
        self.cache_slot.fill_(-1)
        self.base_cache = torch.zeros(0, self.D + 1, device=self.dev)
        self.ebc._mirror_hot_into_cold()
        if self.track_base:
            self._rebase_hot()
