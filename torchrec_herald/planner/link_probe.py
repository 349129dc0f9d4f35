"""Measure the link the job runs on, once at start: its per-rank rate and its per-collective latency, from
timed collectives among the job's ranks, on a process group of the probe's own (``planner.link_mbit=auto`` and
``planner.collective_latency_ms=auto``, the defaults). The planner's model of time
(``planner/time_model.py``) then picks herald's plan, stock TABLE_WISE or TorchRec's default plan
without the user knowing their link. The collectives carry tensors where the training's do
(:func:`~torchrec_herald.dist_utils.collective_device`): CUDA tensors over NCCL on a GPU host, whose process
group also has gloo for CPU tensors, so the probe times the link the embeddings cross, not gloo's TCP.

Hand-written because no library times a process group's links; it costs up to 1.5 s and a few tens of
MB per rank, and every rank ends with the same figures (the times are all-reduced), so every rank makes
the same decision.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_herald.comm import ring_allreduce_bytes
from torchrec_herald.dist_utils import collective_device, device_sync

__all__ = ["LinkProbe", "ProbeTimeout", "abort_failed_group", "agree_on_probe", "await_within", "measured_link",
           "probe_group", "probe_link", "probe_on_every_rank", "within_deadline"]

if TYPE_CHECKING:
    from torchrec_herald.planner.pricing import LinkModel

logger = logging.getLogger(__name__)

#: seconds :func:`probe_link` spends measuring by default (its all-to-alls' and its all-reduces' budgets)
PROBE_BUDGET_S = 1.5


@dataclass(frozen=True)
class LinkProbe:
    """What the start-up probe measured (every rank the same figures)."""

    link_mbit: float
    latency_ms: float
    #: the bytes over one rank's link the rate was measured on (the last size's transfers)
    bytes_per_rank: int
    seconds: float
    #: every byte the probe sent over one rank's link, the doubling sizes included (0: not counted)
    total_bytes_per_rank: int = 0
    #: the rate all-reduces got (None: not measured)
    allreduce_mbit: Optional[float] = None

    def describe(self) -> str:
        sent = self.total_bytes_per_rank or self.bytes_per_rank
        ar = "" if self.allreduce_mbit is None else f" ({self.allreduce_mbit:,.0f} for all-reduces)"
        return (f"measured link: {self.link_mbit:,.0f} Mbit/s per rank{ar}, {self.latency_ms:.2f} ms per collective "
                f"({sent / 2**20:.1f} MiB per rank in {self.seconds:.2f} s)")

    def as_dict(self) -> Dict[str, Any]:
        return {"link_mbit": self.link_mbit, "allreduce_mbit": self.allreduce_mbit,
                "collective_latency_ms": self.latency_ms,
                "bytes_per_rank": self.bytes_per_rank, "total_bytes_per_rank": self.total_bytes_per_rank,
                "seconds": self.seconds, "text": self.describe()}


def _sync(device: torch.device) -> None:
    wait = device_sync(device)  # (on a GPU a collective's wait() orders the stream; the host waits here)
    if wait is not None:
        wait()


class ProbeTimeout(RuntimeError):
    """A probe collective did not complete within the probe's timeout on the host's clock."""


def await_within(work: Any, timeout: timedelta, *, poll: bool) -> None:
    """Wait for ``work`` (a collective's ``dist.Work``) for at most ``timeout`` of the host's clock, raising
    :class:`ProbeTimeout` after it (and the collective's own error, if it failed).

    ``poll=False`` waits in ``work.wait(timeout)``: gloo's wait times out and the job goes on. NCCL's, timing out,
    marks its work failed, and the group's watchdog then ends the process. So ``poll=True`` asks
    ``work.is_completed()``, which never blocks, until the deadline: a peer that never enters the collective costs
    ``timeout``, its work is left pending, and the caller aborts the probe's group (:func:`abort_failed_group`) before
    the group's own timeout. Hand-written: torch has no wait that gives up without failing the work."""
    if not poll:
        work.wait(timeout)
        return
    start = time.monotonic()
    while not work.is_completed():
        waited = time.monotonic() - start
        if waited > timeout.total_seconds():
            raise ProbeTimeout(f"a probe collective took over {timeout.total_seconds():g} s")
        time.sleep(0 if waited < 0.002 else 50e-6)  # (a timed transfer's end seen at once; then no core spun)
    work.wait()  # (its error, if it failed; on a GPU it orders the current stream after it)


def _timed(op: Any, timeout: timedelta, device: torch.device = torch.device("cpu"), poll: bool = False) -> float:
    _sync(device)
    t0 = time.perf_counter()
    await_within(op(True), timeout, poll=poll)
    _sync(device)
    return time.perf_counter() - t0


def _slowest(seconds: float, pg: Optional[dist.ProcessGroup], timeout: timedelta,
             device: torch.device = torch.device("cpu"), poll: bool = False) -> float:
    """The largest of every rank's ``seconds`` (so every rank decides alike)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    await_within(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True), timeout, poll=poll)
    return float(t.item())


def probe_link(pg: Optional[dist.ProcessGroup], *, budget_s: float = 1.0, timeout_s: float = 30.0,
               min_bytes: int = 256 << 10, max_bytes: int = 16 << 20, target_s: float = 0.1,
               repeats: int = 3, device: Optional[torch.device] = None, allreduce_budget_s: float = 0.5,
               poll: Optional[bool] = None) -> LinkProbe:
    """Time the link of ``pg`` (collective: every rank calls it), with tensors on ``device`` (default
    :func:`~torchrec_herald.dist_utils.collective_device`: CUDA where the group carries CUDA tensors, the time
    then taken to the device's end).

    Latency: the median of 20 one-element all-reduces (after 2 warm-ups), slowest rank. Rate: an
    all-to-all of ``n`` bytes per rank (split evenly over the ranks), doubling ``n`` from ``min_bytes``
    until one takes ``target_s``, reaches ``max_bytes`` or the probe spends ``budget_s``, then repeated
    at that size (``repeats`` in all, within the budget); the rate is the bytes that cross this rank's
    link, ``n·(W−1)/W`` per transfer, over the median of the slowest rank's times less one latency. The all-reduce
    rate likewise, with all-reduces of ``n`` bytes (``2·n·(W−1)/W`` over each rank's link, a ring's) within
    ``allreduce_budget_s`` more. Each collective is waited for within ``timeout_s`` of the host's clock
    (:func:`await_within`; ``poll`` None: by polling where the tensors are CUDA ones, NCCL's).

    Raises:
        RuntimeError: a collective failed or took longer than ``timeout_s`` (the caller falls back to the
            configured values).
    """
    W = dist.get_world_size(pg)
    if W < 2:
        raise RuntimeError("one rank: no link to measure")
    timeout = timedelta(seconds=timeout_s)
    dev = collective_device(pg) if device is None else device
    poll = dev.type == "cuda" if poll is None else poll
    start = time.perf_counter()
    one = torch.zeros(1, device=dev)
    # the median of 20: robust to a rank's passing background work at start, yet it keeps the cost of
    # ranks that share cores (which every collective of the training pays too)
    lat = [_timed(lambda a: dist.all_reduce(one, group=pg, async_op=a), timeout, dev, poll) for _ in range(22)][2:]
    latency = _slowest(statistics.median(lat), pg, timeout, dev, poll)
    # one untimed all-to-all first: NCCL connects a pair's point-to-point channels at their first use, which
    # would count as link time in the first timed one (gloo's are connected already)
    warm = torch.zeros(W, device=dev)
    await_within(dist.all_to_all_single(torch.empty_like(warm), warm, group=pg, async_op=True), timeout, poll=poll)
    _sync(dev)

    def all_to_all(n: int) -> Tuple[Any, int]:
        per_peer = max(n // (4 * W), 1)  # float32 elements to each rank
        send, recv = torch.ones(per_peer * W, device=dev), torch.empty(per_peer * W, device=dev)
        return (lambda a: dist.all_to_all_single(recv, send, group=pg, async_op=a)), per_peer * 4 * (W - 1)

    def all_reduce(n: int) -> Tuple[Any, int]:
        x = torch.ones(max(n // 4, 1), device=dev)
        return (lambda a: dist.all_reduce(x, group=pg, async_op=a)), int(ring_allreduce_bytes(x.numel() * 4, W))

    timing = _Timing(pg, timeout, dev, latency, min_bytes, max_bytes, target_s, repeats, poll)
    rate, sent, total = timing.rate(all_to_all, budget_s - 22 * latency)
    ar_rate, _, ar_total = timing.rate(all_reduce, allreduce_budget_s)
    return LinkProbe(link_mbit=rate, latency_ms=latency * 1e3, bytes_per_rank=sent,
                     seconds=time.perf_counter() - start, total_bytes_per_rank=total + ar_total,
                     allreduce_mbit=ar_rate)


@dataclass(frozen=True)
class _Timing:
    """How :func:`probe_link` times one collective kind's rate (every stop decided on the slowest rank's times, the
    same on every rank: a rank deciding on its own clock could leave the others waiting in a collective)."""

    pg: Optional[dist.ProcessGroup]
    timeout: timedelta
    device: torch.device
    latency: float
    min_bytes: int
    max_bytes: int
    target_s: float
    repeats: int
    poll: bool = False

    def _time(self, op: Any) -> float:
        return _slowest(_timed(op, self.timeout, self.device, self.poll), self.pg, self.timeout, self.device,
                        self.poll)

    def rate(self, make: Any, budget_s: float) -> Tuple[float, int, int]:
        """(Mbit/s, the bytes over one rank's link the rate was measured on, every byte sent): ``make(n)`` gives the
        collective of ``n`` bytes and the bytes it sends over one rank's link; ``n`` doubles as :func:`probe_link`
        says, within ``budget_s``."""
        spent, total, n = 0.0, 0, self.min_bytes
        while True:
            op, sent = make(n)
            t = self._time(op)
            spent, total = spent + t, total + sent
            if t >= self.target_s or 2 * n > self.max_bytes or spent + 2 * t > budget_s:
                break
            n *= 2
        # TCP over a rate-limited link alternates between fast and slow transfers of one size: the rate is
        # the median over repeats of the last size (a fast one moved 18 % of 2-rank probes that averaged two by
        # over 10 %, 4 % of those taking the median of three: benchmarks/probe_spread.py)
        times = [t]
        while len(times) < self.repeats and spent + t <= budget_s:
            times.append(self._time(op))
            spent, total = spent + times[-1], total + sent
        rate = sent * 8 / max(statistics.median(times) - self.latency, 1e-6) / 1e6
        return rate, sent * len(times), total


def agree_on_probe(probe: Optional[LinkProbe], pg: Optional[dist.ProcessGroup],
                   timeout_s: float = 60.0) -> Optional[LinkProbe]:
    """``probe`` where every rank's probe succeeded, else None on every rank (collective). A probe can fail on
    one rank alone (its last wait timing out as the others' finish): that rank would plan with the configured
    values and the others with measured ones, and ranks planning apart can wait in different collectives.

    Raises:
        RuntimeError: the process group cannot carry one small all-reduce after the probe (naming the probe).
    """
    ok = torch.tensor([0 if probe is None else 1], dtype=torch.int32, device=collective_device(pg))
    try:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg, async_op=True).wait(timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - one line naming where the job's process group failed
        raise RuntimeError(f"the process group failed right after the start-up link probe ({e}); check the "
                           f"ranks' network, or give planner.link_mbit and planner.collective_latency_ms") from e
    if int(ok.item()) == 1:
        return probe
    if probe is not None:
        logger.warning("planner: another rank's link probe failed; every rank plans with the configured link "
                       "values (planner.link_mbit / planner.collective_latency_ms)")
    return None


def probe_group(pg: Optional[dist.ProcessGroup], timeout_s: float) -> dist.ProcessGroup:
    """A process group of ``pg``'s ranks and backend for the probe alone (collective over ``pg``'s ranks only),
    whose operations time out after ``timeout_s`` (the probe's own waits, given less, fire first): a rank whose probe
    fails before a collective the others entered leaves those unmatched in this group, never in the job's, where
    they would pair with the job's next collectives. A rank whose probe failed aborts this group
    (:func:`abort_failed_group`), before its own timeout: NCCL's watchdog would otherwise end the process whose
    collective timed out, as it would on the job's group."""
    ranks = dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(pg), timeout=timedelta(seconds=timeout_s),
                          use_local_synchronization=_is_subgroup(ranks), group_desc="herald_link_probe")


def _is_subgroup(ranks: list[int]) -> bool:
    """A group of these ranks is made by its members alone (named by its ranks), not by the whole job."""
    return len(ranks) < dist.get_world_size()


def probe_on_every_rank(pg: Optional[dist.ProcessGroup], timeout_s: float = 30.0,
                        own_thread: Optional[bool] = None) -> Optional[LinkProbe]:
    """:func:`probe_link` on a group of ``pg``'s own (:func:`probe_group`; collective), logged in one line; None
    on every rank where it failed on any, its group's creation included (one warning: the planner then plans with the
    configured link values). A rank whose probe fails reaches the agreement on ``pg`` at once; the others there
    within ``timeout_s``, their waits in the probe's group timing out, so the agreement waits twice that.
    ``own_thread`` (None: where the group's collectives are CUDA ones, NCCL's): the probe runs on a thread of its own,
    and a probe blocked inside a call gives up after ``timeout_s`` and twice :data:`PROBE_BUDGET_S`
    (:func:`within_deadline`). Gloo connects every pair as the group is made, so its calls return at once and its
    waits time out: there the probe runs on the caller's thread, as the training's collectives do (on a shaped link a
    probe on a thread of its own read gloo's all-to-all at the full rate in 3 of 24 probes, against 0 of 24 on the
    caller's thread, where the training's get about half of it)."""
    probe, group = None, None
    try:
        group = probe_group(pg, 2 * timeout_s)
        dev = collective_device(group)  # (the rank's device, read on its own thread)
        measure = functools.partial(probe_link, group, timeout_s=timeout_s, device=dev)
        if own_thread if own_thread is not None else dev.type == "cuda":
            probe = within_deadline(measure, timeout_s + 2 * PROBE_BUDGET_S, dev)
        else:
            probe = measure()
        logger.info("planner: %s", probe.describe())
    except Exception as e:  # noqa: BLE001 - a failed probe must not stop training: the configured values
        logger.warning("planner: the link probe failed (%s); planning with the configured link values "
                       "(planner.link_mbit / planner.collective_latency_ms)", e)
        abort_failed_group(group)
    agreed = agree_on_probe(probe, pg, timeout_s=2 * timeout_s)
    # every rank done with it: freed, where the job's ranks name their groups by a count that a freed group does
    # not take back (a subgroup's is named by its ranks and the number of groups, which a freed one would give the
    # next subgroup of the same ranks: kept). A failed probe's group stays registered (aborted), for the same reason.
    if agreed is not None and group is not None and not _is_subgroup(dist.get_process_group_ranks(group)):
        dist.destroy_process_group(group)
    return agreed


def within_deadline(job: Callable[[], Any], seconds: float, device: Optional[torch.device] = None) -> Any:
    """``job()`` on a thread of its own, joined for at most ``seconds``: its result or its error, or
    :class:`ProbeTimeout` where it has not returned by then. A probe call can block before it returns a work to wait
    for (NCCL connects a group's communicator, and a pair's channels, inside the first collective that uses them,
    until the peer comes): the thread is then left blocked (a daemon) and the caller aborts the group it blocks in.
    ``device``: a CUDA device the thread makes its current one (a thread starts on device 0, whatever its rank's).
    Hand-written: torch bounds no collective's call, only the wait for its result."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            box["value"] = job()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="herald-link-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise ProbeTimeout(f"the link probe did not finish in {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def abort_failed_group(group: Optional[dist.ProcessGroup]) -> None:
    """Abort the probe's ``group`` on this rank, where its probe failed. Over NCCL its communicators and its
    watchdog stop, so a collective left unmatched in it (a peer failed before entering it, or this rank gave up
    waiting) neither ends the process at the group's timeout nor holds the device; gloo's backend has no abort (a
    no-op: its unmatched operations time out at the group's timeout, and the job goes on). The group stays
    registered: a subgroup's name counts the groups made. A failed abort is logged, not raised (the probe's warning
    is the user's one line)."""
    if group is None:
        return
    try:
        group.abort()
    except Exception as e:  # noqa: BLE001 - the job goes on with the configured values either way
        logger.debug("planner: aborting the failed link probe's process group: %s", e)


def measured_link(pg: Optional[dist.ProcessGroup], cpu_us_per_lookup: Optional[float] = None
                  ) -> Optional["LinkModel"]:
    """The link ``pg`` runs on, measured (collective, up to 1.5 s), as the model of time prices it: a
    :class:`~torchrec_herald.planner.pricing.LinkModel` for ``HeraldPlanner(link=...)``, the same on every rank, so
    that :meth:`HeraldPlanner.decide` picks herald's plan or a stock one as the command line does. None on every rank
    where the probe failed on any (one warning): the planner then takes the ``Topology``'s stated bandwidth, if
    any. One rank (or no process group) has no link to measure: :meth:`LinkModel.local`, nothing probed."""
    from torchrec_herald.planner.pricing import LinkModel

    cpu = LinkModel.cpu_us_per_lookup if cpu_us_per_lookup is None else cpu_us_per_lookup
    local = LinkModel.local(cpu)  # (checks cpu_us_per_lookup before any collective)
    if not dist.is_initialized() or dist.get_world_size(pg) < 2:
        return local
    probe = probe_on_every_rank(pg)
    if probe is None:
        return None
    return LinkModel(link_mbit=probe.link_mbit, collective_latency_ms=probe.latency_ms, cpu_us_per_lookup=cpu,
                     allreduce_mbit=probe.allreduce_mbit)
