"""TrafficMeter: counts every ``torch.distributed`` collective made while it is active.

It wraps the Python collective API that TorchRec's comm ops, DDP's comm hooks and our own code call
(``torch.distributed.all_to_all_single`` etc.), so stock TorchRec and herald are measured by the same
rule. Each call is attributed to the calling rank as *bytes this rank sends to other ranks*:

============================  =====================================================================
collective                    bytes sent to other ranks by this rank (N = payload bytes, W = world)
============================  =====================================================================
all_to_all_single             sum of the input rows destined to ranks != self (exact, from splits;
                              N·(W−1)/W with equal splits)
all_to_all                    sum of the input tensors destined to ranks != self
all_reduce                    ring all-reduce: 2·(W−1)/W·N
reduce_scatter_tensor         ring reduce-scatter of the N-byte input: (W−1)/W·N
reduce_scatter                ring reduce-scatter of the concatenated inputs: (W−1)/W·ΣN_i
all_gather_into_tensor        ring all-gather of the N-byte local input: (W−1)·N
all_gather                    ring all-gather of the N-byte local input: (W−1)·N
broadcast                     source rank: (W−1)·N (flat fan-out), other ranks: 0
send / isend                  N
barrier, recv                 0 (call counted)
============================  =====================================================================

Floating-point payloads are also counted as *embedding vectors* = bytes / (dim · itemsize) when a
dim is known: either the meter's ``embedding_dim`` (applies to float all-to-all / reduce-scatter /
all-gather payloads, which is where TorchRec's sharded embeddings and their gradients travel) or an
explicit ``with meter.tag("hot_allreduce", dim=16)`` around a call site. ``all_reduce`` payloads are
embedding vectors only when tagged with a dim (DDP's dense gradients are not).

DDP's gradient all-reduce runs in C++ and is invisible to Python unless DDP calls a Python comm hook:
:class:`MeteredDataParallelWrapper` registers PyTorch's stock ``allreduce_hook`` (same reduction) so
those bytes are counted too.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

logger = logging.getLogger(__name__)

#: how long a meter timing completions waits at its exit for its collectives still in flight
IN_FLIGHT_WAIT_S = 30.0

_WRAPPED = (
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather",
    "broadcast",
    "send",
    "isend",
    "recv",
    "irecv",
    "barrier",
)


@dataclass
class CollectiveStats:
    """Counters for one collective kind (or one tag)."""

    calls: int = 0
    bytes: int = 0
    embedding_vectors: float = 0.0

    def add(self, other: "CollectiveStats") -> None:
        self.calls += other.calls
        self.bytes += other.bytes
        self.embedding_vectors += other.embedding_vectors

    def as_dict(self) -> Dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "embedding_vectors": self.embedding_vectors}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_info(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(world size, this rank's index) in ``group``."""
    return dist.get_world_size(group), dist.get_rank(group)


def _a2a_single_bytes(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[Sequence[int]],
                      input_split_sizes: Optional[Sequence[int]], group: Optional[dist.ProcessGroup] = None,
                      **_: Any) -> tuple[int, torch.Tensor]:
    world, rank = _group_info(group)
    if input.dim() == 0 or input.shape[0] == 0:
        return 0, input
    row_bytes = _nbytes(input) // input.shape[0]
    if input_split_sizes is None or len(input_split_sizes) == 0:
        rows_out = input.shape[0] - input.shape[0] // world
    else:
        rows_out = sum(int(s) for j, s in enumerate(input_split_sizes) if j != rank)
    return rows_out * row_bytes, input


def _bytes_for(name: str, args: tuple, kwargs: dict) -> tuple[int, Optional[torch.Tensor]]:
    """Bytes this rank sends to others for one call, and a representative payload tensor (for dtype)."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name == "all_to_all_single":
        return _a2a_single_bytes(arg(0, "output"), arg(1, "input"), arg(2, "output_split_sizes"),
                                 arg(3, "input_split_sizes"), group=arg(4, "group"))
    if name == "barrier":
        return 0, None
    if name == "all_to_all":
        inputs: List[torch.Tensor] = arg(1, "input_tensor_list")
        world, rank = _group_info(arg(2, "group"))
        return sum(_nbytes(t) for j, t in enumerate(inputs) if j != rank), inputs[0] if inputs else None
    if name == "all_reduce":
        t = arg(0, "tensor")
        world, _ = _group_info(arg(2, "group"))
        return (2 * (world - 1) * _nbytes(t)) // world, t
    if name == "reduce_scatter_tensor":
        t = arg(1, "input")
        world, _ = _group_info(arg(3, "group"))
        return ((world - 1) * _nbytes(t)) // world, t
    if name == "reduce_scatter":
        ts: List[torch.Tensor] = arg(1, "input_list")
        world, _ = _group_info(arg(3, "group"))
        return ((world - 1) * sum(_nbytes(t) for t in ts)) // world, ts[0] if ts else None
    if name == "all_gather_into_tensor":
        t = arg(1, "input_tensor")
        world, _ = _group_info(arg(2, "group"))
        return (world - 1) * _nbytes(t), t
    if name == "all_gather":
        t = arg(1, "tensor")
        world, _ = _group_info(arg(2, "group"))
        return (world - 1) * _nbytes(t), t
    if name == "broadcast":
        t = arg(0, "tensor")
        g = arg(2, "group")
        world, rank = _group_info(g)
        src, group_src = arg(1, "src"), kwargs.get("group_src")
        is_src = rank == group_src if src is None else dist.get_rank() == src
        return ((world - 1) * _nbytes(t) if is_src else 0), t
    if name in ("send", "isend"):
        t = arg(0, "tensor")
        return _nbytes(t), t
    return 0, None  # recv / irecv


class TrafficMeter:
    """Context manager counting the collectives of this process while active.

    Example::

        with TrafficMeter(embedding_dim=16) as meter:
            loss = pipeline.progress(it)
        meter.summary()  # {"all_to_all_single": {"calls": 6, "bytes": ..., "embedding_vectors": ...}, ...}

    Meters nest: every active meter sees each call. A collective made *inside* another wrapped
    collective (e.g. ``all_gather`` falling back to per-tensor calls) is counted once, at the outermost.
    A worker thread's calls made for the steps a meter counts (herald's run-ahead scheduler, whose job can
    outlast the step that submitted it) count in the meters named by :meth:`counting_in` instead, whether or
    not those are active at the moment of the call.
    """

    _active: List["TrafficMeter"] = []
    _lock = threading.Lock()
    _originals: Dict[str, Callable[..., Any]] = {}
    _local = threading.local()
    _users = 0  # active meters and threads counting in meters of their own: the wrappers stay installed meanwhile

    def __init__(self, embedding_dim: Optional[int] = None, completion_times: bool = False) -> None:
        self.embedding_dim = embedding_dim
        #: time each collective from its call to its completion (:attr:`duration_by_tag`); an async call's through a
        #: callback on its future, which runs on the backend's thread: the meter's exit waits (up to
        #: :data:`IN_FLIGHT_WAIT_S`) for the calls still in flight, so that no callback is left to run while the
        #: interpreter shuts down (a C++ thread taking the GIL then is ended mid-call: ``terminate called without an
        #: active exception``). Gloo's collectives complete their futures when done; a CUDA future (NCCL) completes
        #: once its kernels are queued, and gloo's send/recv have no future (their call's time is counted): the figure
        #: is a CPU/gloo benchmark's. Off by default (``bench_bandwidth`` sets it)
        self.completion_times = completion_times
        #: record :attr:`arrivals` and :attr:`needed` (on with ``completion_times``; the trainer turns it on for a
        #: window of steps alone: :func:`measured_peer_wait`)
        self.arrival_times = completion_times
        self._in_flight: List[Any] = []
        self._generation = 0  # (a reset's: a call made before it adds nothing after it)
        self._by_kind: Dict[str, CollectiveStats] = {}
        self._by_tag: Dict[str, CollectiveStats] = {}
        self._tag_stacks: Dict[int, List[tuple[str, Optional[int]]]] = {}  # per thread: its tags, innermost last
        self._owner = threading.get_ident()  # the training thread: its waits are the step's comm wait
        self.wait_s = 0.0  # wall time the training thread blocked in collectives (sync calls + async waits)
        self.wait_by_tag: Dict[str, float] = {}  # the same, per tag label ("untagged" for the rest)
        self.wait_other_threads_s = 0.0  # the same in other threads (herald's run-ahead scheduler): off the step
        #: with ``completion_times``, per tag label ("untagged" for the rest) and per collective kind: seconds from
        #: each call to its completion (an async collective's whole time, overlapped or waited for)
        self.duration_by_tag: Dict[str, float] = {}
        self.duration_by_kind: Dict[str, float] = {}
        #: with :attr:`arrival_times`, the training thread's collectives' call times (``time.perf_counter``), in call
        #: order, and when it first waited for each one's result (a sync call's own time, an async call's first
        #: ``wait()`` on the training thread; None for one never waited for so, as DDP's all-reduce, which autograd
        #: waits for in its C++: no part of :attr:`wait_s`): ranks on one host share that clock, so each rank's wait
        #: for its latest peer to arrive at the k-th collective can be read off them (:func:`peer_lateness`). Two
        #: floats a collective, kept until :meth:`reset`: a benchmark's timed block, not a whole training run
        self.arrivals: List[float] = []
        self.needed: List[Optional[float]] = []

    # ------------------------------------------------------------------ activation
    @property
    def _tags(self) -> List[tuple[str, Optional[int]]]:
        """This thread's tag stack (threads tag their own collectives: herald's run-ahead scheduler runs its
        exchanges while the training thread runs its own)."""
        return self._tag_stacks.setdefault(threading.get_ident(), [])

    def __enter__(self) -> "TrafficMeter":
        self._owner = threading.get_ident()
        with TrafficMeter._lock:
            TrafficMeter._use(+1)
            TrafficMeter._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:  # (after an error a peer may never join: nothing is waited for)
            self._wait_in_flight()
        with TrafficMeter._lock:
            TrafficMeter._active.remove(self)
            TrafficMeter._use(-1)
            self._in_flight = []

    def _wait_in_flight(self) -> None:
        """Wait, up to :data:`IN_FLIGHT_WAIT_S`, for the collectives this meter times that are still in flight (their
        completions count while the meter is open); a warning names those left."""
        with TrafficMeter._lock:
            in_flight = list(self._in_flight)
        deadline = time.monotonic() + IN_FLIGHT_WAIT_S
        while (left := [f for f in in_flight if not f.done()]) and time.monotonic() < deadline:
            time.sleep(0.005)
        if left:
            logger.warning("TrafficMeter: %d collective(s) still in flight %g s after the meter's block ended; "
                           "their completion times are not counted", len(left), IN_FLIGHT_WAIT_S)

    @classmethod
    def _use(cls, n: int) -> None:
        """One more (``+1``) or one fewer (``-1``) user of the wrappers (call under ``_lock``)."""
        cls._users += n
        if n > 0 and cls._users == 1:
            cls._install()
        elif n < 0 and cls._users == 0:
            cls._uninstall()

    @classmethod
    def counting(cls) -> List["TrafficMeter"]:
        """The meters this thread's collectives count in now: those :meth:`counting_in` gave it, or the active ones."""
        own = getattr(cls._local, "meters", None)
        return list(own) if own is not None else list(cls._active)

    @classmethod
    def counted_here(cls, job: Callable[..., Any]) -> Callable[..., Any]:
        """``job``, to run on a worker thread, its collectives counted in the meters counting on this thread now (as
        any thread's, in the meters active then, where none is)."""
        meters = cls.counting()
        if not meters:
            return job

        def counted(*args: Any, **kwargs: Any) -> Any:
            with cls.counting_in(meters):
                return job(*args, **kwargs)

        return counted

    @classmethod
    @contextlib.contextmanager
    def counting_in(cls, meters: List["TrafficMeter"]) -> Iterator[None]:
        """This thread's collectives inside the block count in ``meters`` alone, active or not: a worker's job
        submitted while they counted a step (:class:`~torchrec_herald.pipeline.run_ahead.RunAhead`) is counted
        whole, where its calls made between two steps, or in another run's turn, reached no meter or another's."""
        before, mine = getattr(cls._local, "meters", None), list(meters)
        with cls._lock:
            cls._use(+1)
        cls._local.meters = mine
        try:
            yield
        finally:
            cls._local.meters = before
            with cls._lock:
                cls._use(-1)

    @contextlib.contextmanager
    def tag(self, label: str, dim: Optional[int] = None) -> Iterator[None]:
        """Attribute collectives inside the block to ``label``; ``dim`` makes float payloads count
        as embedding vectors of that dimension (also for all_reduce)."""
        self._tags.append((label, dim))
        try:
            yield
        finally:
            self._tags.pop()

    # ------------------------------------------------------------------ counting
    def _record(self, kind: str, nbytes: int, payload: Optional[torch.Tensor]) -> None:
        label, dim = self._tags[-1] if self._tags else (None, None)
        vectors = 0.0
        if payload is not None and payload.is_floating_point():
            if dim is None and kind not in ("all_reduce", "broadcast", "send", "isend"):
                dim = self.embedding_dim
            if dim:
                vectors = nbytes / (dim * payload.element_size())
        s = CollectiveStats(1, int(nbytes), vectors)
        self._by_kind.setdefault(kind, CollectiveStats()).add(s)
        if label is not None:
            self._by_tag.setdefault(label, CollectiveStats()).add(s)

    def summary(self) -> Dict[str, Dict[str, float]]:
        """Per collective kind: calls, bytes sent to other ranks, embedding vectors sent."""
        return {k: v.as_dict() for k, v in sorted(self._by_kind.items())}

    def tag_summary(self) -> Dict[str, Dict[str, float]]:
        """Per tag label (only tagged calls)."""
        return {k: v.as_dict() for k, v in sorted(self._by_tag.items())}

    def total(self) -> Dict[str, float]:
        """Every kind of collective's counters summed (calls, bytes, embedding vectors)."""
        tot = CollectiveStats()
        for v in self._by_kind.values():
            tot.add(v)
        return tot.as_dict()

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._by_kind.clear()
        self._by_tag.clear()
        self.wait_s = 0.0
        self.wait_by_tag.clear()
        self.wait_other_threads_s = 0.0
        self.duration_by_tag.clear()
        self.duration_by_kind.clear()
        with TrafficMeter._lock:  # (a wait() setting ``needed`` holds it too: it never writes into the cleared lists)
            self._generation += 1
            self._in_flight = []
            self.arrivals.clear()
            self.needed.clear()

    def _current_label(self) -> str:
        return self._tags[-1][0] if self._tags else "untagged"

    @classmethod
    def _add_wait(cls, seconds: float, labels: Dict[int, str]) -> None:
        me = threading.get_ident()
        for meter in cls.counting():
            if me != meter._owner:
                meter.wait_other_threads_s += seconds
                continue
            meter.wait_s += seconds
            label = labels.get(id(meter), "untagged")
            meter.wait_by_tag[label] = meter.wait_by_tag.get(label, 0.0) + seconds

    @classmethod
    def _add_duration(cls, seconds: float, kind: str, meters: List["TrafficMeter"], labels: Dict[int, str],
                      generations: Optional[Dict[int, int]] = None) -> None:
        """Add a call's duration to those of ``meters`` still open (and not reset since the call)."""
        with cls._lock:  # (an async collective completes on its backend's thread)
            for meter in meters:
                if meter not in cls._active or (generations is not None
                                                 and generations.get(id(meter)) != meter._generation):
                    continue
                label = labels.get(id(meter), "untagged")
                meter.duration_by_tag[label] = meter.duration_by_tag.get(label, 0.0) + seconds
                meter.duration_by_kind[kind] = meter.duration_by_kind.get(kind, 0.0) + seconds

    # ------------------------------------------------------------------ patching
    @classmethod
    def _install(cls) -> None:
        for name in _WRAPPED:
            orig = getattr(c10d, name)
            cls._originals[name] = orig
            wrapped = cls._make_wrapper(name, orig)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    @classmethod
    def _uninstall(cls) -> None:
        for name, orig in cls._originals.items():
            setattr(c10d, name, orig)
            setattr(dist, name, orig)
        cls._originals.clear()

    @classmethod
    def _make_wrapper(cls, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(cls._local, "depth", 0)
            meters = cls.counting()
            labels = {id(m): m._current_label() for m in meters}
            if depth == 0 and meters:
                nbytes, payload = _bytes_for(name, args, kwargs)
                for meter in meters:
                    meter._record(name, nbytes, payload)
            cls._local.depth = depth + 1
            t0 = time.perf_counter()
            try:
                work = orig(*args, **kwargs)
            finally:
                cls._local.depth = depth
                if depth == 0:
                    cls._add_wait(time.perf_counter() - t0, labels)
            timed = [m for m in meters if m.completion_times]
            if depth == 0 and timed:
                _time_to_completion(cls, name, work, t0, timed, labels)
            # an async call returns its Work (``async_op`` by keyword or by position, ``isend``/``irecv``); a sync one
            # returns None (``recv`` its sender's rank)
            is_async = depth == 0 and isinstance(work, dist.Work)
            slots = []  # (meter, index of this call in its arrivals, its generation): the wait() that first needs it
            arriving = [m for m in meters if m.arrival_times] if depth == 0 else []
            if arriving:
                me = threading.get_ident()
                with cls._lock:
                    for m in arriving:
                        if m._owner == me:
                            slots.append((m, len(m.arrivals), m._generation))
                            m.arrivals.append(t0)
                            m.needed.append(None if is_async else t0)
            if is_async:
                return _TimedWork(work, cls, labels, slots)  # the exposed part of an async collective is its wait()
            return work

        wrapper.__name__ = name
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper._herald_meter = True  # type: ignore[attr-defined]
        return wrapper


def peer_lateness(arrivals: Sequence[Sequence[float]],
                  needed: Optional[Sequence[Sequence[Optional[float]]]] = None) -> List[float]:
    """Per rank, the seconds it waited for its latest peer to arrive, summed over its collectives: the k-th
    collective of each rank's ``arrivals`` (:attr:`TrafficMeter.arrivals`; ranks on one host: one clock) is matched
    across the ranks, and rank r waited ``max(0, max(arrivals[:][k]) - needed[r][k])`` at it, where ``needed`` is
    when it first waited for the result (:attr:`TrafficMeter.needed`: an async call's ``wait()``; default: its
    call). A peer's lateness that an async call's overlap covers is not waited for; a call never waited for so
    (``needed`` None) adds nothing.

    Raises:
        ValueError: the ranks made different numbers of collectives (their k-th calls are not one collective).
    """
    needed = arrivals if needed is None else needed
    if not arrivals or len(needed) != len(arrivals):
        raise ValueError(f"peer_lateness: {len(arrivals)} ranks' arrivals and {len(needed)} ranks' waits; every "
                         f"rank needs both")
    counts = {len(a) for a in arrivals} | {len(n) for n in needed}
    if len(counts) != 1:
        raise ValueError(f"peer_lateness: the ranks made different numbers of collectives ({sorted(counts)}); "
                         f"their calls cannot be matched")
    latest = [max(ts) for ts in zip(*arrivals)]
    return [sum(max(0.0, m - t) for m, t in zip(latest, n) if t is not None) for n in needed]


def clock_offsets(group: Optional[dist.ProcessGroup] = None, rounds: int = 9) -> List[float]:
    """Each rank's ``time.perf_counter`` minus rank 0's, in seconds (collective): 0 where every rank runs on one
    kernel (one boot, one monotonic clock, containers and network namespaces included); across hosts, the median over
    ``rounds`` blocking all-reduces of when each rank left it. The ranks leave one within about a hop's latency of
    each other, so across hosts each collective's wait is known to about that. Hand-written: torch has no clock
    sync."""
    hosts: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, _clock_identity(), group=group)
    if len(set(hosts)) == 1:
        return [0.0] * len(hosts)
    out = torch.zeros(rounds, dtype=torch.float64)
    one = torch.zeros(1)
    for i in range(rounds):
        dist.all_reduce(one, group=group)
        out[i] = time.perf_counter()
    every = [torch.empty_like(out) for _ in hosts]
    dist.all_gather(every, out, group=group)
    return [float((t - every[0]).median()) for t in every]


def _clock_identity() -> str:
    """What names this kernel's monotonic clock: its boot id (the hostname where there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def measured_peer_wait(meter: "TrafficMeter", steps: int, group: Optional[dist.ProcessGroup] = None,
                       offsets: Optional[List[float]] = None) -> Optional[List[float]]:
    """Each rank's wait for its latest peer, ms per step, over the ``steps`` steps whose collectives ``meter``
    recorded with :attr:`TrafficMeter.arrival_times` (collective; every rank the same list): :func:`peer_lateness`
    of the ranks' calls on one clock (:func:`clock_offsets`). None where no step was recorded, at one rank (no peer),
    or where the ranks' recorded calls do not match one for one (a rank's extra collective). ``offsets``: the ranks'
    clocks as :func:`clock_offsets` read them when the steps were recorded (default: read now; across hosts, clocks
    drift apart over a run, by up to tens of ms an hour)."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return None
    mine = (list(meter.arrivals), list(meter.needed))
    every: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if offsets is None:
        offsets = clock_offsets(group)
    if steps <= 0 or not any(a for a, _ in every):
        return None
    arrivals = [[t - off for t in a] for (a, _), off in zip(every, offsets)]
    needed = [[None if t is None else t - off for t in n] for (_, n), off in zip(every, offsets)]
    try:
        late = peer_lateness(arrivals, needed)
    except ValueError as e:
        logger.info("no peer wait measured: %s", e)
        return None
    return [1000 * s / steps for s in late]


def _completion_future(work: Any) -> Any:
    """``work``'s future (None: a synchronous call's result, or a backend's work without one)."""
    if not isinstance(work, dist.Work):
        return None
    try:
        return work.get_future()
    except RuntimeError:  # (a backend whose works have no future)
        return None


def _time_to_completion(meter_cls: Any, name: str, work: Any, t0: float, meters: List["TrafficMeter"],
                        labels: Dict[int, str]) -> None:
    """Add the call's time from ``t0`` to its completion to ``meters``' durations: now for a synchronous call, when
    its future completes for an async one."""
    future = _completion_future(work)
    if future is None:
        meter_cls._add_duration(time.perf_counter() - t0, name, meters, labels)
        return
    generations = {id(m): m._generation for m in meters}

    def completed(done: Any) -> None:
        try:
            done.value()
        except Exception:  # noqa: BLE001 - a failed collective has no completion time
            return
        meter_cls._add_duration(time.perf_counter() - t0, name, meters, labels, generations)

    # (``then``: its future completes once the callback has run, which the meter's exit can wait for)
    timed = future.then(completed)
    with meter_cls._lock:
        for meter in meters:  # (those completed let go: a future holds its collective's tensors)
            meter._in_flight = [f for f in meter._in_flight if not f.done()] + [timed]


class _TimedWork(dist.Work):
    """An async collective's ``Work`` whose ``wait()`` time counts as communication wait (the time a
    collective overlapped with other work is not waited for, so it is not exposed). A ``dist.Work``
    subclass: TorchRec checks ``isinstance(req, dist.Work)`` before waiting."""

    def __init__(self, work: Any, meter_cls: Any, labels: Dict[int, str],
                 slots: Sequence[tuple[Any, int, int]] = ()) -> None:
        super().__init__()
        self._work, self._meter_cls, self._labels = work, meter_cls, labels
        self._slots = list(slots)  # (meter, its arrival's index, its generation) whose ``needed`` the first wait sets

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        if self._slots:
            me = threading.get_ident()
            with self._meter_cls._lock:  # (the training thread's wait alone is on its step's path)
                for meter, i, generation in self._slots:
                    if meter._owner == me and meter._generation == generation and i < len(meter.needed):
                        meter.needed[i] = t0
            self._slots = []
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._meter_cls._add_wait(time.perf_counter() - t0, self._labels)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self) -> Any:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> Any:
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def reduce_summaries(summary: Dict[str, Dict[str, float]], group: Optional[dist.ProcessGroup] = None
                     ) -> Dict[str, Dict[str, float]]:
    """Sum per-rank summaries over all ranks (call outside any meter; every rank must call it)."""
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, summary, group=group)
    out: Dict[str, Dict[str, float]] = {}
    for s in gathered:
        for kind, stats in s.items():
            acc = out.setdefault(kind, {"calls": 0, "bytes": 0, "embedding_vectors": 0.0})
            for k, v in stats.items():
                acc[k] += v
    return dict(sorted(out.items()))


class MeteredDataParallelWrapper:
    """TorchRec ``DataParallelWrapper`` that makes every DDP all-reduce visible to TrafficMeter.

    It wraps the dense part in DDP exactly like TorchRec's ``DefaultDataParallelWrapper``, then
    registers PyTorch's stock ``allreduce_hook`` (divide by world size, all-reduce: the reduction DDP
    does in C++) on that DDP, tagged ``dense_allreduce``, and on the DDPs TorchRec builds inside
    DATA_PARALLEL-sharded tables, tagged ``data_parallel_table_allreduce`` with ``embedding_dim`` (so
    their gradient rows count as embedding vectors; TorchRec flattens those weights, so the dim
    cannot be read off the parameter).
    """

    def __init__(self, embedding_dim: Optional[int] = None, **kwargs: Any) -> None:
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

        self._embedding_dim = embedding_dim
        self._inner = DefaultDataParallelWrapper(**kwargs)

    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        self._inner.wrap(dmp, env, device)
        # TorchRec keeps DATA_PARALLEL tables' DDPs in plain lists (``_lookups``), not as submodules
        candidates = list(dmp.modules()) + [lk for m in dmp.modules() for lk in getattr(m, "_lookups", [])]
        for module in {id(m): m for m in candidates}.values():
            if not isinstance(module, DistributedDataParallel):
                continue
            if module is dmp._dmp_wrapped_module:
                label, dim = "dense_allreduce", None
            else:
                label, dim = "data_parallel_table_allreduce", self._embedding_dim
            module.register_comm_hook(module.process_group, _tagged_allreduce_hook(allreduce_hook, label, dim))


@contextlib.contextmanager
def traffic_tag(label: str, dim: Optional[int] = None) -> Iterator[None]:
    """Tag the collectives inside the block on every meter they count in (a no-op when none is)."""
    with contextlib.ExitStack() as stack:
        for meter in TrafficMeter.counting():
            stack.enter_context(meter.tag(label, dim))
        yield


def _tagged_allreduce_hook(hook: Callable[..., Any], label: str, dim: Optional[int]) -> Callable[..., Any]:
    def tagged(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        with traffic_tag(label, dim):
            return hook(state, bucket)

    # DDP inspects the hook's annotations; postponed (string) annotations would not match.
    tagged.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                              "return": torch.futures.Future[torch.Tensor]}
    return tagged
