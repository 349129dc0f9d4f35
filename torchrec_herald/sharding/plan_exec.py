"""Executes Herald's communication plan on one rank (docs/design.md §3, Herald (b)): pulls of missing or outdated
rows into the worker cache, gradient reduce at one reducer per row with the exact update there, lazy
pushes home; with HET's bounded staleness, pushes that add an accumulated update.

In plan mode every row a rank reads is local when its forward runs (a hot replica, a row of its own
ROW_WISE block, or a cache entry of its :class:`~torchrec_herald.sharding.row_store.RowStore`). A transfer
carries the row's current value and, for row-wise Adagrad, its state: what the merged pending updates add
up to, bit for bit, without re-summing deltas. The plan is known to every rank, so no ids travel.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_herald.comm import all_to_all_rows_async
from torchrec_herald.keymap import expand_ranges
from torchrec_herald.plans import ExecPlan, FlushPlan
from torchrec_herald.sharding.row_store import RowStore, add_rows_in_order, host_positions_to_device, host_to_device

logger = logging.getLogger(__name__)

__all__ = ["PlanExecutor", "merge_additive_pushes"]


def _flag_for_host(flag: torch.Tensor) -> Any:
    """A 0-d ``flag`` made on a GPU, on its way to the host: copied into pinned memory without blocking, an
    event recorded after the copy. :func:`_read_flag` then waits for that event alone, that is for the kernels
    queued up to the flag, where reading the flag itself would synchronise the whole stream (after a backward:
    every backward kernel). On a CPU, the flag."""
    if not flag.is_cuda:
        return flag
    host = torch.empty((), dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(flag.device))  # (the stream the copy went on: the flag's device's)
    return host, done


def _read_flag(flag: Any) -> bool:
    """The value of a flag from :func:`_flag_for_host`."""
    if isinstance(flag, tuple):
        host, done = flag
        done.synchronize()
        return bool(host)
    return bool(flag)


def _flags(add: Optional[torch.Tensor], transfers: torch.Tensor) -> torch.Tensor:
    """The per-transfer add flags of ``transfers`` (all False when the plan gives none)."""
    return add if add is not None and add.numel() else torch.zeros(len(transfers), dtype=torch.bool)


def merge_additive_pushes(phases: List[torch.Tensor], flags: List[Optional[torch.Tensor]], pulls: torch.Tensor,
                          world: int, native: Optional[Any] = None
                          ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The three phases of pushes (``(key, src, dst)`` transfers, with their add flags) and the pulls as one
    transfer list, with each transfer's add flag and phase, or None where a rank pushes one row twice
    (:meth:`PlanExecutor._additive_pushes_with_next_pulls` states the rule). ``native``: the compiled
    module, which does it in one pass (``additive_merge``); the torch ops below are its reference."""
    if native is not None:
        none = torch.empty(0, dtype=torch.bool)
        ok, merged, add, phase = native.additive_merge(*(t.to(torch.int64) for t in phases),
                                                       *(none if f is None else f for f in flags),
                                                       pulls.to(torch.int64), world)
        return (merged, add, phase) if ok and merged.numel() else None
    pushes = torch.cat(phases)
    add = torch.cat([_flags(f, t) for f, t in zip(flags, phases)])
    phase = torch.repeat_interleave(torch.arange(3), torch.tensor([len(t) for t in phases]))
    # each row's pushes in the order its home applies them: by key, then phase, then pushing rank
    W = world
    order = torch.argsort((pushes[:, 0] * 3 + phase) * W + pushes[:, 1])
    p_key, p_src, p_add = pushes[order, 0], pushes[order, 1], add[order]
    by_rank = torch.sort(p_key * W + p_src)[0]
    if bool((by_rank[1:] == by_rank[:-1]).any()):
        return None
    wanted = pulls[:, 0].contiguous()
    lo = torch.searchsorted(p_key, wanted)
    hi = torch.searchsorted(p_key, wanted, right=True)
    first = lo.clamp(max=max(p_key.numel() - 1, 0))
    replaced = (hi > lo) & ~p_add[first] if p_key.numel() else torch.zeros_like(wanted, dtype=torch.bool)
    pulls = pulls.clone()
    pulls[replaced, 1] = p_src[first[replaced]]  # read where the replacing push comes from
    # the added updates each puller applies after the row: its pushes from ``start`` to ``hi``
    at, which = expand_ranges(lo + replaced.to(torch.int64), hi)
    copies = torch.stack([p_key[at], p_src[at], pulls[which, 2]], 1)
    merged = torch.cat([pushes, pulls, copies])
    if not merged.numel():
        return None
    return (merged,
            torch.cat([add, torch.zeros(len(pulls), dtype=torch.bool), torch.ones(len(copies), dtype=torch.bool)]),
            torch.cat([phase, torch.zeros(len(pulls), dtype=torch.int64), phase[order][at]]))


class PlanExecutor:
    """The transfers of each step's :class:`~torchrec_herald.plans.ExecPlan` on one rank's rows.

    Args:
        store: this rank's rows.
        pg: the process group the plan's ranks are in.
    """

    def __init__(self, store: RowStore, pg: Optional[dist.ProcessGroup]) -> None:
        self.store, self.pg = store, pg
        self.rank, self.W, self.D = store.rank, store.layout.world_size, store.dim
        self.width = self.D + (1 if store.adagrad else 0)  # floats per transferred row
        # the step in flight: its plan, the rows its forward reads (sorted keys) and their values
        self.plan: Optional[ExecPlan] = None
        #: a plan ran since the last :meth:`flush`: rows may be newer in caches than at home, hot replicas
        #: outdated (the tables and a forward off the plan read the home blocks)
        self.unflushed = False
        self.ws: Optional[torch.Tensor] = None
        self.ws_keys = torch.empty(0, dtype=torch.int64)
        self.frozen_keys = torch.empty(0, dtype=torch.int64)  # stale-update skipping: rows read, not updated
        self._update_rows_of: Optional[Tuple[ExecPlan, torch.Tensor, Tuple[torch.Tensor, ...]]] = None
        # a plan whose pulls are in flight (prefetch): (plan, work, received rows, positions per source, keys,
        # add flags, push phases)
        self._prefetched: Optional[Tuple[ExecPlan, Any, Any, List[torch.Tensor], torch.Tensor, torch.Tensor,
                                         Optional[torch.Tensor]]] = None
        # the step's gradient reduce, started by the working set's gradient hook inside backward:
        # (per source, the positions received; the buffer; the work), and its route, found in begin()
        self._reduce: Optional[Tuple[List[torch.Tensor], torch.Tensor, Any]] = None
        self._reduce_route: Optional[Tuple[torch.Tensor, List[int], List[torch.Tensor], List[int]]] = None
        # plan mode: whether the forward's keys differ from the plan's reads (a 0-d flag checked at finish)
        self._check: Optional[Any] = None  # the forward's rows-match-the-plan flag (_flag_for_host)
        self._reduce_rows: Optional[torch.Tensor] = None  # see _set_working_set
        # the plan's reads where the forward's keys are (the rows' device), copied once per step in begin()
        self._planned_on: Tuple[Optional[torch.Tensor], torch.Tensor] = (None, self.ws_keys)

    # ------------------------------------------------------------------ one step
    @property
    def active(self) -> bool:
        """A planned step is in flight (:meth:`begin` ran, :meth:`finish` did not yet)."""
        return self.plan is not None

    def begin(self, plan: ExecPlan) -> None:
        """Run the plan's pre-read transfers (collective) and, before the forward, everything of the step
        that reads sizes or values on the host: the working set's rows (each key's slot) and the route
        of the gradient reduce. Forward and backward then size nothing by the data (on a GPU the host
        never waits for the device inside them)."""
        # what depends on the plan alone first: where the pulls were prefetched, they travel meanwhile
        route = self._route(plan.reduce) if plan.reduce.numel() or plan.partial else None
        planned = plan.reads[self.rank]
        whole = not self.frozen_keys.numel()  # the working set is the plan's reads
        reduce_rows = None
        if whole:
            self._planned_where(planned, self.store.device)  # copied now, before the forward
            if route is not None:
                reduce_rows = self._reduce_rows_of(planned, plan, route)
            self._update_rows(plan, planned)
        self.before_forward(plan)
        self.plan = plan
        self.unflushed = True
        self._reduce_route = route
        self._check, self.ws = None, None
        if whole:
            self._set_working_set(self.store.read(planned)[0], planned, reduce_rows)

    def _planned_where(self, planned: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``planned`` (the plan's reads, on CPU) on ``device``: the copy :meth:`begin` made, or a new one."""
        src, on = self._planned_on
        if src is not planned or on.device != device:
            self._planned_on = (planned, host_to_device(planned, device))
        return self._planned_on[1]

    def working_set(self, keys: torch.Tensor) -> torch.Tensor:
        """The forward's lookups ``keys``: load the step's working set (the plan's reads, plus frozen
        rows it leaves out) as a leaf :attr:`ws` and return each key's position in it, computed where
        ``keys`` are (on a GPU the batch's keys never go to the host)."""
        assert self.plan is not None
        planned = self.plan.reads[self.rank]
        if not self.frozen_keys.numel():  # the plan's reads, loaded by begin(); checked at finish()
            if self.ws is None or self.ws_keys is not planned:  # (rows unfrozen after begin: load them now)
                self._set_working_set(self.store.read(planned)[0], planned)
            n = planned.numel()
            if not n and keys.numel():  # (sizes the host knows: no sync)
                raise RuntimeError(f"rank {self.rank}: the batch's rows differ from the ones the plan was made for")
            if not keys.numel():
                self._check = torch.tensor(n > 0)
                return keys
            native = self.store.native
            if native is not None and keys.device.type == "cpu" and keys.dtype == planned.dtype == torch.int64:
                pos, self._check = native.plan_positions(planned, keys)  # the same, in one pass
                return pos
            on = self._planned_where(planned, keys.device)
            at = torch.searchsorted(on, keys).clamp_(max=n - 1)
            wrong = on[at] != keys  # (a key past every planned one lands on the last, which differs)
            unread = ~torch.zeros(n, dtype=torch.bool, device=keys.device).index_fill_(0, at, True)
            # a 0-d flag the host reads only after backward (finish): nothing waits inside forward
            self._check = _flag_for_host(wrong.any() | unread.any())
            return at
        device, keys = keys.device, keys.cpu()  # stale-update skipping: matched on the host, as the plan is
        ws_keys = torch.unique(keys)
        extra = ws_keys[~torch.isin(ws_keys, planned)]
        if planned.numel() + extra.numel() != ws_keys.numel() or not bool(torch.isin(extra, self.frozen_keys).all()):
            raise RuntimeError(f"rank {self.rank}: the batch's rows differ from the ones the plan was made for")
        w, _ = self.store.read(ws_keys)
        self._set_working_set(w, ws_keys)
        return host_to_device(torch.searchsorted(ws_keys, keys), device)

    def _set_working_set(self, w: torch.Tensor, keys: torch.Tensor, reduce_rows: Optional[torch.Tensor] = None
                         ) -> None:
        """The forward's rows as a leaf; once backward has its gradient (the forward looks the working
        set up once), the reduce starts, overlapping the rest of backward and DDP's all-reduce.
        ``reduce_rows``: :meth:`_reduce_rows_of` these keys, found earlier."""
        self.ws, self.ws_keys = w.requires_grad_(True), keys
        self._reduce = None
        self.ws.register_post_accumulate_grad_hook(self._start_reduce)
        # the working-set rows of the gradients this rank sends in the reduce, found now (before the
        # forward) and placed on the rows' device, so the hook inside backward only indexes
        route = self._reduce_route
        if reduce_rows is None and route is not None and self.plan is not None:
            reduce_rows = self._reduce_rows_of(keys, self.plan, route)
        self._reduce_rows = reduce_rows if route is not None else None

    def _reduce_rows_of(self, keys: torch.Tensor, plan: ExecPlan,
                        route: Tuple[torch.Tensor, List[int], List[torch.Tensor], List[int]]) -> torch.Tensor:
        """Positions among the working set's ``keys`` of the gradients this rank sends in ``plan``'s
        reduce (``route``: its :meth:`_route`), on the rows' device."""
        return host_to_device(torch.searchsorted(keys, plan.reduce[:, 0][route[0]]), self.store.device)

    def _start_reduce(self, ws: torch.Tensor) -> None:
        plan = self.plan
        if plan is None or ws is not self.ws or self._reduce is not None or ws.grad is None:
            return
        if not plan.reduce.numel() and not plan.partial:
            return
        grad, rows = ws.grad.detach(), self._reduce_rows
        assert rows is not None  # (found with the working set: the plan has a reduce, so it has a route)
        self._reduce = self._start_exchange(plan.reduce, lambda _: grad[rows], "herald_reduce", self.D,
                                            route=self._reduce_route)

    def finish(self, next_plan: Optional[ExecPlan] = None) -> None:
        """After backward: reduce, exact update, pushes and evictions of the plan (collective);
        ``next_plan``: the next step's plan where it is already made: its pulls (and pushes before its
        reads) then travel with this step's pushes in one all-to-all (:meth:`_pushes_with_next_pulls`,
        :meth:`_additive_pushes_with_next_pulls`)."""
        plan, ws = self.plan, self.ws
        if plan is None or ws is None:
            raise RuntimeError("finish_plan_step without a planned forward (call begin_plan_step first)")
        if self._check is not None and _read_flag(self._check):
            self.plan, self.ws, self._reduce, self._check = None, None, None, None
            raise RuntimeError(f"rank {self.rank}: the batch's rows differ from the ones the plan was made for")
        grad = ws.grad if ws.grad is not None else torch.zeros_like(ws)
        self.plan, self.ws = None, None
        started, self._reduce = self._reduce, None
        planned = plan.reads[self.rank]  # frozen rows' gradients are dropped
        grad = grad.detach() if planned.numel() == self.ws_keys.numel() else \
            grad.detach()[host_to_device(torch.searchsorted(self.ws_keys, planned), grad.device)]
        self.after_backward(plan, planned, grad, started, next_plan)

    def run_without_gradients(self, plan: ExecPlan) -> None:
        """Execute ``plan`` as a step whose batch is not trained (collective): its transfers run and every
        planned update gets a zero gradient, which leaves each value and Adagrad state bit for bit as it
        was (``w - 0``, ``s + 0``). Brings the rows in step with a planner that planned ahead."""
        if self.plan is not None:
            raise RuntimeError("run_without_gradients with a planned step in flight")
        self.before_forward(plan)
        planned = plan.reads[self.rank]
        self.after_backward(plan, planned, torch.zeros(planned.numel(), self.D, device=self.store.device))

    # ------------------------------------------------------------------ transfers
    def _route(self, transfers: torch.Tensor) -> Tuple[torch.Tensor, List[int], List[torch.Tensor], List[int]]:
        """Of ``transfers`` (``(key, src, dst)``, known to every rank): the positions this rank sends,
        grouped by destination, and their counts; per source, the positions it receives, and their counts
        (each group in plan order)."""
        me, W = self.rank, self.W
        native = self.store.native_locate  # (wherever the rows are: the plans are the host's)
        if native is not None:  # one counting pass
            send_pos, send_counts, recv_pos, recv_counts = native.plan_route(
                transfers.to(torch.int64).contiguous(), me, W)
            recv = recv_counts.tolist()
            return send_pos, send_counts.tolist(), list(recv_pos.split(recv)), recv
        src, dst = transfers[:, 1], transfers[:, 2]
        send_pos = (src == me).nonzero().squeeze(1)
        send_pos = send_pos[torch.argsort(dst[send_pos], stable=True)]
        recv_pos = (dst == me).nonzero().squeeze(1)
        recv_pos = recv_pos[torch.argsort(src[recv_pos], stable=True)]
        send_counts = torch.bincount(dst[send_pos], minlength=W).tolist()
        recv_counts = torch.bincount(src[recv_pos], minlength=W).tolist()
        return send_pos, send_counts, list(recv_pos.split(recv_counts)), recv_counts

    def _start_exchange(self, transfers: torch.Tensor, payload: Callable[[torch.Tensor], torch.Tensor], label: str,
                        width: int, route: Optional[Tuple[torch.Tensor, List[int], List[torch.Tensor], List[int]]] = None
                        ) -> Tuple[List[torch.Tensor], torch.Tensor, Any]:
        """Start one all-to-all of the rows of ``transfers`` (``(key, src, dst)``, known to every rank): for
        each destination this rank sends ``payload(i)``, ``i`` the positions in ``transfers`` of its rows
        to it; returns (per source, the positions of the rows received from it; the buffer they arrive
        in; the collective's work, to wait for). ``route``: :meth:`_route` of ``transfers``, found earlier."""
        send_pos, send_counts, recv_pos, recv_counts = route if route is not None else self._route(transfers)
        send = payload(send_pos) if send_pos.numel() else torch.zeros(0, width, device=self.store.device)
        out, work = all_to_all_rows_async(send, send_counts, recv_counts, self.pg, label, width)
        return recv_pos, out, work

    def _exchange(self, transfers: torch.Tensor, payload: Callable[[torch.Tensor], torch.Tensor], label: str,
                  width: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """:meth:`_start_exchange`, waited for: (per source, the positions received from it; the rows)."""
        recv_pos, out, work = self._start_exchange(transfers, payload, label, width)
        work.wait()
        return recv_pos, out

    def _row_payload(self, keys: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """Each row's value (+ Adagrad state); for ``add`` rows the accumulated update (value − base)."""
        rows = self.store.payload(keys, add)
        return rows if self.store.adagrad else rows[:, : self.D]

    def move_rows(self, transfers: torch.Tensor, label: str, add: Optional[torch.Tensor] = None,
                  partial: bool = False) -> None:
        """One all-to-all for the ``(key, src, dst)`` rows of ``transfers`` (known to every rank, or with
        ``partial`` this rank's share of them, which runs the collective even when empty): src sends
        the row's current value (+ state), dst stores it — or, where ``add`` is set, src sends its
        accumulated update and dst adds it. Sources are applied in rank order (a row's one replacing
        push comes from the lowest pushing rank, as the staleness planner assigns it)."""
        if not transfers.numel() and not partial:
            return
        store = self.store
        keys = transfers[:, 0]
        add = _flags(add, transfers)
        recv_pos, out = self._exchange(transfers, lambda i: self._row_payload(keys[i], add[i]), label, self.width)
        if store.track_base:  # what this rank pushed is now part of the home's copy
            sent = keys[transfers[:, 1] == self.rank]
            if sent.numel():
                store.rebase(sent)
        self._store_received(keys, add, recv_pos, out)

    def _store_received(self, keys: torch.Tensor, add: torch.Tensor, recv_pos: List[torch.Tensor],
                        out: torch.Tensor, phase: Optional[torch.Tensor] = None,
                        order: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Write the rows received from each source, in rank order (``add``: add to the current value).
        ``phase`` (per transfer, where one all-to-all carries pushes of successive phases of the plan):
        every replacing row is written first (a row has at most one, a pull or the first push of the
        row), then the added updates by phase, then by source rank: the order the home applies them in,
        so that what a puller stores is the home's row bit for bit."""
        if phase is not None and self.store.native is not None:  # one compiled pass stores them in sequence
            self._store_in_home_order(keys, add, recv_pos, out, phase, order)
            return
        if phase is None and recv_pos:
            arriving = torch.cat(recv_pos)  # (in source order, as the rows in ``out``)
            if not bool(add[arriving].any()):
                # every row replaces (a row has at most one replacing row an exchange): one store of them
                # all, not one a source (some 20 host ops each, W of them)
                if arriving.numel():
                    self.store.receive(keys[arriving], out, add[arriving])
                return
        parts = list(zip(recv_pos, out.split([i.numel() for i in recv_pos])))
        if phase is None:  # added updates: each source's after the one before it, in rank order
            for pos, rows in parts:
                if rows.numel():
                    self.store.receive(keys[pos], rows, add[pos])
            return
        for pos, rows in parts:
            replace = ~add[pos]
            if bool(replace.any()):
                self.store.receive(keys[pos[replace]], rows[host_positions_to_device(replace, rows.device)],
                                   add[pos[replace]])
        for ph in range(int(phase.max()) + 1 if phase.numel() else 0):
            for pos, rows in parts:
                now = add[pos] & (phase[pos] == ph)
                if bool(now.any()):
                    self.store.receive(keys[pos[now]], rows[host_positions_to_device(now, rows.device)], now[now])

    def _home_order(self, keys: torch.Tensor, add: torch.Tensor, recv_pos: List[torch.Tensor],
                    phase: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_store_received`'s order (replacing rows, then added updates by phase, then by source) as
        one stable sort of the received rows: ``(their positions in the transfers, the order)``. The
        replacing rows' keys get their cache slots now, so no added update meets a row not held yet.
        Found from the plans alone: :meth:`before_forward` finds it while the rows travel."""
        if not recv_pos:
            return keys[:0], keys[:0]
        pos = torch.cat(recv_pos)
        src = torch.repeat_interleave(torch.arange(len(recv_pos)), torch.tensor([p.numel() for p in recv_pos]))
        a = add[pos]
        self.store.reserve(keys[pos[~a]])
        return pos, torch.argsort(torch.where(a, phase[pos] + 1, 0) * len(recv_pos) + src, stable=True)

    def _store_in_home_order(self, keys: torch.Tensor, add: torch.Tensor, recv_pos: List[torch.Tensor],
                             out: torch.Tensor, phase: torch.Tensor,
                             order: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """The received rows stored in :meth:`_home_order` (``order``, where found already) by one store,
        which applies them one after another (the loop over phases and sources cost ~1 ms a step in small
        calls)."""
        pos, at = order if order is not None else self._home_order(keys, add, recv_pos, phase)
        if pos.numel():
            self.store.receive(keys[pos[at]], out[host_to_device(at, out.device)], add[pos][at])

    def prefetch(self, plan: ExecPlan) -> None:
        """Start ``plan``'s pre-read transfers now, while the current step ends (collective): the pushes
        planned before the reads at once, the pulls as an async all-to-all that :meth:`begin` waits for
        (Herald's step order: push the planned rows, then pull the next batch's rows asynchronously). The
        rows sent are read now: nothing changes an embedding row between here and the next forward. A
        bounded-staleness plan's pushes before the reads may add (its pulls never do)."""
        if self.plan is not None or self._prefetched is not None:
            return
        self._start_tracking_base(plan)
        self._push_before_read(plan)
        self._start_pulls(plan, plan.pull, "herald_pull")

    def _start_pulls(self, plan: ExecPlan, transfers: torch.Tensor, label: str,
                     route: Optional[Tuple[torch.Tensor, List[int], List[torch.Tensor], List[int]]] = None,
                     add: Optional[torch.Tensor] = None, phase: Optional[torch.Tensor] = None) -> None:
        """Start the all-to-all of ``transfers`` (``plan``'s pulls, or the previous step's pushes with
        them) as ``plan``'s prefetch: its rows are read now, stored by :meth:`begin`. ``route``: its
        :meth:`_route`, found earlier; ``add``, ``phase``: the rows that carry an accumulated update
        (pushes of a bounded-staleness plan) and their order (:meth:`_store_received`), where given."""
        keys = transfers[:, 0]
        add = _flags(add, transfers)
        recv_pos, out, work = (self._start_exchange(transfers, lambda i: self._row_payload(keys[i], add[i]),
                                                    label, self.width, route) if keys.numel() or plan.partial
                               else ([], None, None))
        self._prefetched = (plan, work, out, recv_pos, keys, add, phase)

    def before_forward(self, plan: ExecPlan) -> None:
        """Pushes planned before the reads, then pulls of missing/outdated rows (or, when :meth:`prefetch`
        started them, wait for its pulls and store them)."""
        if self._prefetched is not None:
            pre, work, out, recv_pos, keys, add, phase = self._prefetched
            self._prefetched = None
            if pre is not plan:
                raise RuntimeError("a prefetched plan must be the next one begun")
            if work is not None:
                # the arriving rows not held yet get their cache slots while they travel (an added update's
                # row is held), and the order they are stored in is found meanwhile
                order = None
                if phase is not None and self.store.native is not None:
                    order = self._home_order(keys, add, recv_pos, phase)
                elif recv_pos:
                    arriving = torch.cat(recv_pos)
                    self.store.reserve(keys[arriving[~add[arriving]]])
                work.wait()
                self._store_received(keys, add, recv_pos, out, phase, order)
            return
        self._start_tracking_base(plan)
        self._push_before_read(plan)
        self.move_rows(plan.pull, "herald_pull", partial=plan.partial)

    def _push_before_read(self, plan: ExecPlan) -> None:
        """The plan's pushes before its reads (where they did not travel with the previous step's pushes,
        :meth:`_additive_pushes_with_next_pulls`)."""
        self.move_rows(plan.push_before_read, "herald_update_push", plan.push_before_read_add, plan.partial)

    def _start_tracking_base(self, plan: ExecPlan) -> None:
        """The first bounded-staleness plan: each copy's base (what its home had when it was read) is kept
        from now on; every replica is in sync with its home when a staleness run starts."""
        if plan.additive and not self.store.track_base:
            self.store.track_base = True
            self.store.rebase_hot()

    def after_backward(self, plan: ExecPlan, ws_keys: torch.Tensor, ws_grad: torch.Tensor,
                       started: Optional[Tuple[List[torch.Tensor], torch.Tensor, Any]] = None,
                       next_plan: Optional[ExecPlan] = None) -> None:
        """Sum each read row's gradients at its reducer, apply the one exact update there, push dirty
        rows home for the next step's readers and on eviction, free evicted cache slots. ``started``:
        the reduce's all-to-all, already started in backward (:meth:`_start_reduce`); ``next_plan``: the
        next step's plan, made already (see :meth:`finish`)."""
        me, store = self.rank, self.store
        dev = store.device
        red_keys = plan.reduce[:, 0]
        # what depends on the plans alone is found before the reduce is waited for (the host is idle then):
        # where this rank's own gradients and each source's land among the updated rows (found by begin()
        # while its pulls travelled, where the working set is the plan's reads) ...
        upd, own_rows, own_grads = self._update_rows(plan, ws_keys)
        total = torch.zeros(upd.numel(), self.D, device=dev)
        # ... and the exact plan's pushes, with the next step's pulls where they travel together, and its route
        pushes = merged = route = merged_add = merged_phase = None
        if not plan.additive:
            pushes = torch.cat([plan.update_push, plan.miss_push])
            merged = self._pushes_with_next_pulls(plan, pushes, next_plan)
        else:
            together = self._additive_pushes_with_next_pulls(plan, next_plan)
            if together is not None:
                merged, merged_add, merged_phase = together
        route = self._route(merged) if merged is not None and merged.numel() else None
        rows = torch.zeros(0, self.D, device=dev)
        recv_pos: List[torch.Tensor] = []
        work = None
        if started is not None:
            recv_pos, rows, work = started
        elif plan.reduce.numel() or plan.partial:
            recv_pos, rows, work = self._start_exchange(
                plan.reduce, lambda i: ws_grad[host_to_device(torch.searchsorted(ws_keys, red_keys[i]), dev)],
                "herald_reduce", self.D)
        # the gradients are summed in one op whatever W is, deterministically (in rank order on a CPU): the
        # received ones (in source order) with this rank's own between those of the ranks below and above it
        before = sum(i.numel() for i in recv_pos[:me])
        found = torch.searchsorted(upd, red_keys[torch.cat(recv_pos)] if recv_pos else red_keys[:0])
        at = host_to_device(torch.cat([found[:before], own_rows, found[before:]]), dev)
        if work is not None:
            work.wait()
        add_rows_in_order(total, at, torch.cat([rows[:before], ws_grad[own_grads], rows[before:]]))
        if upd.numel():
            store.apply_gradient(upd, total)
        if plan.additive and merged is not None:  # pushes with the next step's pulls, waited for by begin()
            assert next_plan is not None and merged_add is not None
            self._start_pulls(next_plan, merged, "herald_push_pull", route, merged_add, merged_phase)
            n_push = len(plan.update_push) + len(plan.miss_push) + len(next_plan.push_before_read)
            sent = merged[:n_push][merged[:n_push, 1] == me, 0]  # what this rank pushed is now its home's
            if sent.numel():
                store.rebase(sent)
        elif plan.additive:  # additive pushes: in the planner's order (update pushes, then evictions) ...
            up, mp = plan.update_push, plan.miss_push
            if not bool(torch.isin(up[:, 0], mp[:, 0]).any()):  # ... one all-to-all where no row is in both
                self.move_rows(torch.cat([up, mp]), "herald_update_push",
                               torch.cat([_flags(plan.update_push_add, up), _flags(plan.miss_push_add, mp)]))
            else:
                self.move_rows(up, "herald_update_push", plan.update_push_add)
                self.move_rows(mp, "herald_update_push", plan.miss_push_add)
        elif merged is None:  # exact plan: every push replaces, disjoint rows: one all-to-all ...
            assert pushes is not None
            self.move_rows(pushes, "herald_update_push", partial=plan.partial)
        else:  # ... which also carries the next step's pulls, started now and waited for by begin()
            assert next_plan is not None
            self._start_pulls(next_plan, merged, "herald_push_pull", route)
        store.drop(plan.evictions[me])  # (a merged all-to-all packed its rows already)

    def _update_rows(self, plan: ExecPlan, ws_keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows this rank updates in ``plan`` (its reducer's) and, among them and the working set's
        ``ws_keys``, which it read and where their gradients are: ``(keys, the positions among them of those
        read, their working-set positions)``, the last on the rows' device. Kept for the plan's
        :meth:`after_backward` (:meth:`begin` finds them while its pulls travel)."""
        found = self._update_rows_of
        if found is not None and found[0] is plan and found[1] is ws_keys:
            return found[2]
        upd = plan.update_keys[plan.reducer == self.rank]
        own = torch.searchsorted(ws_keys, upd).clamp(max=max(ws_keys.numel() - 1, 0))
        read = ws_keys[own] == upd if ws_keys.numel() else torch.zeros_like(upd, dtype=torch.bool)
        rows = (upd, read.nonzero().squeeze(1), host_to_device(own[read], self.store.device))
        self._update_rows_of = (plan, ws_keys, rows)
        return rows

    def _pushes_with_next_pulls(self, plan: ExecPlan, pushes: torch.Tensor,
                                next_plan: Optional[ExecPlan]) -> Optional[torch.Tensor]:
        """The exact plan's pushes and ``next_plan``'s pulls as one transfer list, or None where they must
        stay two collectives. A pull from a row's home that this step's push brings home is sent by the
        pusher instead: it holds the same value now (bit for bit: a push replaces the home's copy with
        it), so the pulls need not wait for the pushes, and one all-to-all (one round trip, not two)
        carries both, started right after the update.

        Both plans must be exact and whole (every rank holds the same plans, so every rank decides
        alike), the next one without pushes before its reads (look-ahead plans have none), no pull
        rerouted to the rank that receives it (a row its cache evicts now and reads next), and no rank
        receiving one row twice."""
        if (next_plan is None or plan.additive or next_plan.additive or plan.partial or next_plan.partial
                or self.store.track_base or next_plan.push_before_read.numel()):
            return None
        pulls = next_plan.pull
        if not pulls.numel():
            return pushes if pushes.numel() else None
        if pushes.numel():
            W = self.W
            pushed_to = pushes[:, 0] * W + pushes[:, 2]  # (key, the rank it goes to)
            order = torch.argsort(pushed_to)
            pushed_to = pushed_to[order]
            wanted = pulls[:, 0] * W + pulls[:, 1]  # (key, the rank the pull reads it from)
            at = torch.searchsorted(pushed_to, wanted).clamp_(max=pushed_to.numel() - 1)
            hit = pushed_to[at] == wanted
            if bool(hit.any()):
                pulls = pulls.clone()
                pulls[hit, 1] = pushes[order[at[hit]], 1]
                if bool((pulls[hit, 1] == pulls[hit, 2]).any()):
                    return None
        merged = torch.cat([pushes, pulls])
        landing = torch.sort(merged[:, 0] * self.W + merged[:, 2])[0]
        if bool((landing[1:] == landing[:-1]).any()):
            return None
        return merged

    def _additive_pushes_with_next_pulls(self, plan: ExecPlan, next_plan: Optional[ExecPlan]
                                         ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A bounded-staleness plan's pushes and ``next_plan``'s pulls as one transfer list, with each
        transfer's add flag and phase (:meth:`_store_received`), or None where they must stay apart.

        The pushes come in three phases, applied at a home in this order: the plan's update pushes, its
        evictions' pushes, ``next_plan``'s pushes before its reads; within a phase by pushing rank. A home
        adds a pushed update to its row, so a pull of a pushed row cannot be read from the home after the
        push without a second round trip. Instead it is read before, and each push of that row goes to the
        puller too, who applies them in the home's order: the home's value (or the row's replacing push,
        its first), then the added updates. The floating-point sums are the home's, bit for bit. A rank
        pulling a row it pushes itself sends its own update to itself.

        Both plans must be whole (every rank holds the same plans, so every rank decides alike), and no
        rank may push one row twice (its second update would be sent before the first is taken out)."""
        if (next_plan is None or not plan.additive or not next_plan.additive or plan.partial or next_plan.partial
                or not self.store.track_base):
            return None
        return merge_additive_pushes([plan.update_push, plan.miss_push, next_plan.push_before_read],
                                     [plan.update_push_add, plan.miss_push_add, next_plan.push_before_read_add],
                                     next_plan.pull, self.W, self.store.native_locate)  # (host plans)

    def flush(self, fp: FlushPlan) -> None:
        """Dirty rows home, outdated hot replicas refreshed, caches dropped, home replicas mirrored into
        the cold blocks: the stock herald layout again (eval, checkpoints, a stock pipeline)."""
        if self._prefetched is not None:
            raise RuntimeError("flush with a prefetched plan that did not run: run it first (run_without_gradients)")
        self.move_rows(fp.push, "herald_update_push", fp.push_add, fp.partial)
        self.move_rows(fp.pull, "herald_pull", partial=fp.partial)
        self.store.drop(fp.dropped[self.rank])
        self.store.drop_cache()
        self.store.mirror_hot_into_cold()
        self.unflushed = False
        if self.store.track_base:
            self.store.rebase_hot()
