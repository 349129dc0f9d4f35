"""Slipstream's stale-update skipping (docs/design.md §3): hot rows whose values have saturated stop being trained.

Three stages, repeated every ``every`` steps so rows that wake up are trained again: (1) *snapshot* the hot
rows at the start and at the end of a measuring window of ``gap`` steps (nothing is skipped inside it,
or a frozen row could never show movement); (2) *sample*: on the upcoming inputs of the look-ahead
window, binary-search the threshold ``T ∈ [0, t_max]`` so the skipped share hits ``target ± tolerance``
(a row is stale when every coordinate moved less than ``T``); (3) *classify* inputs until the next
snapshot. Two granularities: ``input`` skips whole samples all of whose lookups are stale hot rows (no
forward, no backward, none of their rows read); ``row`` keeps every sample but excludes stale rows from
the update and from the hot-row synchronisation (their gradients are dropped), which is what cuts the
sync bytes. Opt-in and approximate: the run records its accuracy against the exact reference.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Protocol, Tuple

import torch

from torchrec_herald.option_types import check_int, check_real
from torchrec_herald.pipeline.context import concat_samples, select_samples

logger = logging.getLogger(__name__)

__all__ = ["GRANULARITIES", "LiveInputStream", "RankInputStream", "SkipConfig", "StaleSkipHook", "StaleSkipper",
           "search_threshold"]

#: ``pipeline.skip`` values (``None``: off)
GRANULARITIES = ("input", "row")
#: :class:`RankInputStream` leaves this share of the surplus the sampled skip share promises unread
REFILL_SLACK = 0.1
#: :class:`RankInputStream` reads at most this many slices per step (a skip share of 75 % or more)
MAX_REFILL_RATE = 4.0


#: the largest ``pipeline.skip_t_max``: a row's movement (its values' largest change between two snapshots) is of the
#: order of the values themselves, and the search's 40 halvings of (0, 1000] still resolve 1e-9
T_MAX_LIMIT = 1000.0


@dataclass
class SkipConfig:
    """``pipeline.skip*`` options.

    Args:
        granularity: ``input`` or ``row``.
        target: the skipped share the threshold search aims at (inputs for ``input``, row lookups for
            ``row``), in (0, 1); Slipstream's default 0.3.
        tolerance: the accepted band around ``target``.
        start: step of the first snapshot (training before it is exact).
        gap: steps between the two snapshots of a measuring window (>= 1).
        every: steps between measuring windows (> gap).
        t_max: the largest threshold searched (Slipstream: 0.1).
    """

    granularity: str
    target: float = 0.3
    tolerance: float = 0.08
    start: int = 20
    gap: int = 10
    every: int = 100
    t_max: float = 0.1

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown pipeline.skip {self.granularity!r}; known: {list(GRANULARITIES)} or null")
        for attr in ("target", "tolerance", "t_max"):
            check_real(f"pipeline.skip_{attr}", getattr(self, attr))
        for attr in ("start", "gap", "every"):
            check_int(f"pipeline.skip_{attr}", getattr(self, attr))
        if not 0.0 < float(self.target) < 1.0:
            raise ValueError(f"pipeline.skip_target must be in (0, 1), got {self.target}")
        if not 0.0 <= float(self.tolerance) < min(self.target, 1 - self.target):
            raise ValueError(f"pipeline.skip_tolerance must be in [0, min(target, 1 - target)), got {self.tolerance}")
        if int(self.start) < 0 or int(self.gap) < 1 or int(self.every) <= int(self.gap):
            raise ValueError(f"pipeline.skip_start >= 0, skip_gap >= 1 and skip_every > skip_gap needed; got "
                             f"start={self.start}, gap={self.gap}, every={self.every}")
        if not 0.0 < float(self.t_max) <= T_MAX_LIMIT:  # (the search halves the range 40 times: from 1e30 it finds
            # no threshold below 1e18, and every row counts as stale)
            raise ValueError(f"pipeline.skip_t_max must be in (0, {T_MAX_LIMIT:g}], got {self.t_max}")

    def check_run_length(self, steps: Optional[int]) -> None:
        """Raise when the first measuring window does not end inside a run of ``steps`` steps."""
        if steps is not None and self.start + self.gap >= steps:
            raise ValueError(f"pipeline.skip snapshots at steps {self.start} and {self.start + self.gap} are beyond "
                             f"the run's {steps} steps; lower pipeline.skip_start / skip_gap")


def search_threshold(scores: torch.Tensor, target: float, t_max: float, iterations: int = 40) -> Tuple[float, float]:
    """Binary search of the smallest ``T ∈ [0, t_max]`` whose skipped share (``scores < T``) reaches
    ``target``; returns ``(T, share)``. The share is monotone in T; when even ``t_max`` skips less, the
    result is ``(t_max, its share)`` (the run records the share it achieved)."""
    n = scores.numel()
    if n == 0:
        return 0.0, 0.0

    def share(t: float) -> float:
        return float((scores < t).sum()) / n

    lo, hi = 0.0, float(t_max)
    if share(hi) < target:
        return hi, share(hi)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if share(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, share(hi)


@dataclass
class StaleSkipper:
    """Per-run state of stale-update skipping (the same on every rank: snapshots are taken of flushed,
    identical hot replicas and the threshold search runs on all-gathered scores).

    ``phase(step)``: ``"snapshot_a"`` / ``"snapshot_b"`` at the ends of a measuring window, ``"measure"``
    inside one (nothing skipped), ``"skip"`` when a classification is active, ``"off"`` before the first.
    """

    config: SkipConfig
    num_hot: int
    movement: Optional[torch.Tensor] = None  # [num_hot] max |Δ| of the last measuring window
    snapshot: Optional[torch.Tensor] = None
    threshold: float = 0.0
    achieved_share: float = 0.0
    stale: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))
    history: List[Tuple[int, float, float, int]] = field(default_factory=list)  # step, T, share, stale rows

    def phase(self, step: int) -> str:
        c = self.config
        if step < c.start:
            return "off"
        k, off = divmod(step - c.start, c.every)
        if off == 0:
            return "snapshot_a"
        if off == c.gap:
            return "snapshot_b"
        if off < c.gap:
            return "measure"
        return "skip" if self.stale.numel() else "off"

    def take_snapshot(self, hot_values: torch.Tensor, second: bool) -> None:
        """Record the hot rows (``[num_hot, D]``) at the start (``second=False``) or end of a window."""
        if not second:
            self.snapshot = hot_values.clone()
            self.stale = torch.empty(0, dtype=torch.bool)
            return
        assert self.snapshot is not None
        self.movement = (hot_values - self.snapshot).abs().amax(1) if self.num_hot else torch.empty(0)

    def set_threshold(self, step: int, scores: torch.Tensor) -> None:
        """Search T on the sampled ``scores`` (``input``: per sample, the largest movement among its lookups,
        ``inf`` with a cold lookup or none; ``row``: per lookup, its row's movement, ``inf`` if cold) and
        classify the hot rows."""
        assert self.movement is not None
        c = self.config
        self.threshold, self.achieved_share = search_threshold(scores, c.target, c.t_max)
        self.stale = self.movement < self.threshold
        self.history.append((step, self.threshold, self.achieved_share, int(self.stale.sum())))
        logger.info("stale-update skipping at step %d: T=%.3g, sampled skip share %.3f (target %.2f ± %.2f), "
                    "%d of %d hot rows stale", step, self.threshold, self.achieved_share, c.target, c.tolerance,
                    int(self.stale.sum()), self.num_hot)


class SkipHost(Protocol):
    """What stale-update skipping may ask of the pipeline it is plugged into (and nothing more)."""

    hot_keys: torch.Tensor  # global keys of the hot rows, ascending

    def flush(self) -> None:
        """Bring every replica up to date (collective)."""

    def hot_values(self) -> torch.Tensor:
        """The hot rows' current values ``[num_hot, D]``."""

    def freeze_hot(self, stale: Optional[torch.Tensor], keys: torch.Tensor) -> None:
        """Stop updating the hot rows ``stale`` (their global keys: ``keys``)."""

    def unfreeze_hot(self) -> None:
        """Train every hot row again."""

    def count_skipped(self, candidates: int, skipped: int, inputs: int = 0) -> None:
        """Add to the counters: updates considered, updates skipped, whole inputs skipped."""

    def count_read(self, samples: int) -> None:
        """Add to the data's samples read, all ranks (input skipping that refills its batches)."""

    def window_batches(self) -> List[Any]:
        """This rank's upcoming batches, oldest first."""

    def batch_keys(self, kjt: Any) -> torch.Tensor:
        """Global row key of every id of ``kjt``."""

    def gather_varlen(self, mine: torch.Tensor, label: str) -> List[torch.Tensor]:
        """Every rank's ``mine`` (collective)."""


class StaleSkipHook:
    """Stale-update skipping plugged into ``HeraldTrainPipeline`` through :class:`SkipHost`: the pipeline
    calls :meth:`before_step` at every step, :meth:`filter_inputs` on each batch entering the window
    (``input`` granularity), :meth:`filter_reads` on the window's reads before planning and
    :meth:`count_reads` on the eager path (``row`` granularity). ``frozen_keys``: global keys of the hot
    rows classified stale."""

    def __init__(self, config: SkipConfig, num_hot: int, device_sync: Optional[Callable[[], None]] = None) -> None:
        self.skipper = StaleSkipper(config, num_hot)
        #: waits for the device's queued work (None on a CPU): the search's step time is the device's, read where a
        #: span of timed steps begins or ends (a snapshot, another run's turn), with no wait inside it
        self._device_sync = device_sync
        self.frozen_keys = torch.empty(0, dtype=torch.int64)
        #: input skipping that refills its batches pauses while it costs more time than it saves
        self.paused = False
        #: each threshold search's verdict: (step, paused, classifier ms per step, step ms, skip share)
        self.verdicts: List[Tuple[int, bool, float, float, float]] = []
        self._cost_s = 0.0  # refilling streams' classification time since the last search ...
        self._cost_steps = 0  # ... over this many steps that classified
        self._cost_ms = 0.0  # the last classifier ms per step measured (kept while paused)
        self._step_s = 0.0  # wall time between before_step calls since the last search ...
        self._steps = 0
        self._t_last: Optional[float] = None

    @property
    def granularity(self) -> str:
        return self.skipper.config.granularity

    def stop_clock(self) -> None:
        """The step that just trained ends now (timed up to here); the time until the next step is no step's
        (another run's turn in the same ranks follows)."""
        if self._t_last is not None and self._device_sync is not None:
            self._device_sync()
        self._time_step_ended(time.perf_counter())
        self._t_last = None

    def _time_step_ended(self, now: float) -> None:
        """The step that trained last ended at ``now``: its time since it started into the search's step time."""
        if self._t_last is not None:
            self._step_s, self._steps = self._step_s + now - self._t_last, self._steps + 1

    # ------------------------------------------------------------------ hooks
    def before_step(self, host: SkipHost, step: int) -> None:
        """Snapshots at the ends of each measuring window (after a flush, so every rank sees the same
        hot rows), the threshold search at its end, and the (un)freezing of stale rows."""
        phase = self.skipper.phase(step)
        if self._device_sync is not None and (self._t_last is None or phase in ("snapshot_a", "snapshot_b")):
            self._device_sync()  # (a span's end: the search reads its step time; or its start)
        now = time.perf_counter()
        self._time_step_ended(now)
        self._t_last = now
        if phase not in ("snapshot_a", "snapshot_b"):
            return
        host.flush()
        second = phase == "snapshot_b"
        self.skipper.take_snapshot(host.hot_values(), second=second)
        if second:
            scores, cost_ms, step_ms = self._sampled_scores(host)
            self.skipper.set_threshold(step, scores)
            self._judge(step, cost_ms, step_ms)
        stale = self.skipper.stale if second else None
        self.frozen_keys = host.hot_keys[stale] if stale is not None else torch.empty(0, dtype=torch.int64)
        if self.granularity == "row":
            host.freeze_hot(stale, self.frozen_keys)

    def count_cost(self, seconds: float) -> None:
        """A refilling stream spent ``seconds`` classifying and assembling one step's batch."""
        self._cost_s += seconds
        self._cost_steps += 1

    def _judge(self, step: int, cost_ms: float, step_ms: float) -> None:
        """Input skipping that refills: pause until the next search where the classifier's time per step
        (``cost_ms``, the slowest rank's, measured while it last ran) exceeds what the skipped share ``s``
        saves, i.e. where ``(step + cost) · (1 - s) >= step`` (a step trains ``1 / (1 - s)`` times the
        data's samples for ``cost`` more time). Every rank judges the same gathered figures alike.
        Nothing measured yet (the first search, or no classifier ran): skipping runs."""
        if self.granularity != "input":
            return
        s = self.skipper.achieved_share
        if cost_ms > 0.0 and step_ms > 0.0:
            self.paused = (step_ms + cost_ms) * (1.0 - s) >= step_ms
            logger.info("input skipping at step %d: the classifier costs %.2f ms per step, skipping %.1f %% of a "
                        "%.1f ms step's inputs saves %.2f -> %s", step, cost_ms, 100 * s, step_ms,
                        s * step_ms / max(1.0 - s, 1e-9), "paused until the next search" if self.paused else "on")
        self.verdicts.append((step, self.paused, float(cost_ms), float(step_ms), float(s)))

    def flushes_at(self, step: int) -> bool:
        """Step ``step`` starts with a flush (a snapshot): its plan cannot be made ahead."""
        return self.skipper.phase(step) in ("snapshot_a", "snapshot_b")

    def skipping(self, train_step: int) -> bool:
        """Input granularity: a classification is active for a batch that trains at ``train_step``."""
        return (self.granularity == "input" and self.skipper.phase(train_step) == "skip"
                and bool(self.frozen_keys.numel()) and not self.paused)

    def _drop(self, keys: torch.Tensor, sample: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Of ``n`` samples (``sample[i]`` is key ``i``'s): bool, all of its lookups are stale; its lookups."""
        lookups = torch.bincount(sample, minlength=n)
        stale = torch.bincount(sample, weights=torch.isin(keys, self.frozen_keys).double(), minlength=n)
        return (stale == lookups) & (lookups > 0), lookups

    def classify_inputs(self, host: SkipHost, batch: Any, train_step: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Input granularity, a batch (in the EBC's feature order) that trains at ``train_step``: counts its
        lookups as candidates; None when no classification is active for it, else per sample (bool, all
        of its lookups are stale; its lookups). The caller counts what it drops (:meth:`count_dropped`)."""
        kjt = batch.sparse_features
        B, F = kjt.stride(), len(kjt.keys())
        lengths = kjt.lengths().to(torch.int64)
        host.count_skipped(int(lengths.sum()), 0)
        if not self.skipping(train_step):
            return None
        sample = torch.repeat_interleave(torch.arange(F * B) % B, lengths)
        return self._drop(host.batch_keys(kjt), sample, B)

    @staticmethod
    def count_dropped(host: SkipHost, lookups: torch.Tensor) -> None:
        """Count the skipped inputs whose lookups are ``lookups`` (one entry per input)."""
        if lookups.numel():
            host.count_skipped(0, int(lookups.sum()), int(lookups.numel()))

    def refill_rate(self) -> float:
        """Slices a rank reads per step to train a full batch of live inputs while a classification is
        active: ``(1 - REFILL_SLACK · s) / (1 - s)`` for the sampled skip share ``s`` (the same on every
        rank), at most :data:`MAX_REFILL_RATE`. The slack, a share of the expected surplus, keeps the
        carried surplus near zero however small ``s`` is (a short step is topped up with stale inputs,
        which then train: a little less is skipped, nothing is lost)."""
        s = min(max(self.skipper.achieved_share, 0.0), 1.0 - 1e-9)
        return min(MAX_REFILL_RATE, (1.0 - REFILL_SLACK * s) / (1.0 - s))

    def filter_inputs(self, host: SkipHost, batch: Any, train_step: int) -> Any:
        """Input granularity, this rank's own batch (in the EBC's feature order) that trains at
        ``train_step``: drop the samples all of whose lookups are stale hot rows (at least one sample
        stays); counts skipped inputs and their lookups."""
        verdict = self.classify_inputs(host, batch, train_step)
        if verdict is None:
            return batch
        drop, lookups = verdict
        if bool(drop.all()):
            drop[0] = False
        if not bool(drop.any()):
            return batch
        self.count_dropped(host, lookups[drop])
        return select_samples(batch, (~drop).nonzero().flatten())

    def filter_reads(self, host: SkipHost, reads: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """Row granularity: frozen rows are read but never updated, so the plan leaves them out (their
        replicas were synchronised by the snapshot's flush and stay so); counts the skipped updates."""
        frozen = self.frozen_keys
        out = []
        for k, step_reads in enumerate(reads):
            kept = []
            for r in step_reads:
                f = torch.isin(r, frozen) if frozen.numel() else torch.zeros_like(r, dtype=torch.bool)
                kept.append(r[~f])
                if k == 0:
                    host.count_skipped(r.numel(), int(f.sum()))
            out.append(kept)
        return out

    def count_reads(self, host: SkipHost, rows: torch.Tensor) -> None:
        """Row granularity on the eager path: the step's rows read, and those frozen."""
        host.count_skipped(rows.numel(), int(torch.isin(rows, self.frozen_keys).sum()) if self.frozen_keys.numel() else 0)

    def detach(self, host: SkipHost) -> None:
        """Train every row again (the herald EBC would otherwise keep the stale ones frozen)."""
        self.frozen_keys = torch.empty(0, dtype=torch.int64)
        host.unfreeze_hot()

    # ------------------------------------------------------------------ threshold sampling
    def _movement_of(self, host: SkipHost, keys: torch.Tensor) -> torch.Tensor:
        """Movement (max |Δ| over the last measuring window) of the rows ``keys``; ``inf`` if not hot."""
        assert self.skipper.movement is not None
        hot_keys = host.hot_keys
        pos = torch.searchsorted(hot_keys, keys).clamp(max=max(hot_keys.numel() - 1, 0))
        hot = hot_keys[pos] == keys if hot_keys.numel() else torch.zeros_like(keys, dtype=torch.bool)
        out = torch.full((keys.numel(),), float("inf"))
        out[hot] = self.skipper.movement[pos[hot]]
        return out

    def _timings_since_search(self) -> Tuple[float, float]:
        """This rank's classifier ms per step while it ran (0: never measured; the last figure is kept
        while paused) and its ms per step, since the last search; the accumulators restart."""
        if self._cost_steps:
            self._cost_ms = 1000.0 * self._cost_s / self._cost_steps
        step_ms = 1000.0 * self._step_s / self._steps if self._steps else 0.0
        self._cost_s, self._cost_steps, self._step_s, self._steps = 0.0, 0, 0.0, 0
        return self._cost_ms, step_ms

    def _sampled_scores(self, host: SkipHost) -> Tuple[torch.Tensor, float, float]:
        """Every rank's scores on the window's upcoming batches (``row``: per lookup, its row's movement;
        ``input``: per sample, its largest), all-gathered so every rank searches the same threshold; and
        the slowest rank's classifier ms per step and ms per step (for :meth:`_judge`)."""
        local = []
        for batch in host.window_batches():
            kjt = batch.sparse_features
            B, F = kjt.stride(), len(kjt.keys())
            lengths = kjt.lengths().to(torch.int64)
            mv = self._movement_of(host, host.batch_keys(kjt))
            if self.granularity == "row":
                local.append(mv)
            else:
                sample = torch.repeat_interleave(torch.arange(F * B) % B, lengths)
                worst = torch.full((B,), float("-inf")).scatter_reduce(0, sample, mv, "amax", include_self=True)
                worst[torch.bincount(sample, minlength=B) == 0] = float("inf")  # no lookups: never skipped
                local.append(worst)
        mine = torch.cat(local).float() if local else torch.empty(0)
        # this rank's timings ride on the same gather, as two trailing entries
        parts = host.gather_varlen(torch.cat([mine, torch.tensor(self._timings_since_search())]), "herald_skip_meta")
        return (torch.cat([p[:-2] for p in parts]), max(float(p[-2]) for p in parts),
                max(float(p[-1]) for p in parts))


class LiveInputStream:
    """Slipstream's input classifier on a stream of whole global batches: the samples all of whose
    lookups are stale are dropped and each global batch is refilled from the next ones, so every step
    trains ``size`` live samples and an epoch takes fewer steps (the skipped share of them). Every rank
    reads the same global batches and holds the same classification: all drop the same samples, with
    no collective, so the stream runs ahead with the rest of the scheduling.

    Args:
        hook: the skipping hook (its classification, and the counters through ``host``).
        host: the pipeline (:class:`SkipHost`).
        world: ranks the global batch is split over. Every global batch trained has the loader's
            global batch size (``W·B``, read off its first batch), but the last of the data, which is cut
            to a multiple of ``world`` (at most ``world - 1`` samples of an epoch's tail go untrained).
        feature_order: puts a loader batch in the EBC's feature order.
    """

    def __init__(self, hook: "StaleSkipHook", host: SkipHost, world: int, feature_order: Callable[[Any], Any]) -> None:
        self.hook, self.host, self.world, self.feature_order = hook, host, world, feature_order
        self.size = 0  # the loader's global batch size, from its first batch
        self._left: Optional[Any] = None  # live samples read but not trained yet
        self._src: Optional[Iterator[Any]] = None

    def next(self, it: Iterator[Any], train_step: int) -> Any:
        """The global batch that trains at ``train_step``: ``size`` live samples read from ``it`` (fewer at
        the end of the data); StopIteration when none is left."""
        if it is not self._src:  # a new pass over the data: nothing carried over
            self._src, self._left = it, None
        t0, reading, active = time.perf_counter(), 0.0, self.hook.skipping(train_step)
        parts, n = ([self._left], self._left.labels.shape[0]) if self._left is not None else ([], 0)
        self._left = None
        while n < self.size or not self.size:
            t_read = time.perf_counter()
            try:
                batch = self.feature_order(next(it))
            except StopIteration:
                break
            finally:
                reading += time.perf_counter() - t_read
            self.size = self.size or batch.labels.shape[0]
            self.host.count_read(batch.labels.shape[0])
            batch = self.hook.filter_inputs(self.host, batch, train_step)
            parts.append(batch)
            n += batch.labels.shape[0]
        take = self.size if n >= self.size else n - n % self.world
        if take == 0:
            raise StopIteration
        batch = concat_samples(parts)
        if n > take:
            if n > self.size:
                self._left = select_samples(batch, torch.arange(take, n))
            batch = select_samples(batch, torch.arange(take))
        if active:  # the classifier ran: its time (reading excluded)
            self.hook.count_cost(time.perf_counter() - t0 - reading)
        return batch

    def take_left(self, it: Iterator[Any]) -> Optional[Any]:
        """The live samples read from ``it`` but not trained yet (None if none); forgotten here."""
        left = self._left if it is self._src else None
        self._left = None
        return left


class RankInputStream:
    """Slipstream's input classifier on this rank's own slices (scheduling off: no rank reads another's
    samples). Each step reads ``k`` slices, the same ``k`` on every rank: ``k = 1`` while no
    classification is active, else the running sum of :meth:`StaleSkipHook.refill_rate` decides it (no
    collective). The live samples of those slices, after those carried from earlier steps, fill a batch
    of the slice size ``B``; a surplus is carried to the next step (beyond ``B`` carried, the step trains
    it too), a shortfall is topped up with this step's stale samples, which then train. Every rank
    reads the same slices in the same steps, so every rank runs out of data at the same step; the live
    samples still carried then go untrained (logged), as a ``drop_last`` loader's tail does.

    Args:
        hook: the skipping hook (its classification and refill rate, the counters through ``host``).
        host: the pipeline (:class:`SkipHost`).
        world: ranks a global batch is sliced over: a slice read counts its global batch's samples as
            read (every rank reads its slice of the same global batches).
        feature_order: puts a loader batch in the EBC's feature order.
    """

    def __init__(self, hook: "StaleSkipHook", host: SkipHost, world: int, feature_order: Callable[[Any], Any]) -> None:
        self.hook, self.host, self.world, self.feature_order = hook, host, world, feature_order
        self.size = 0  # the slice size, from the first slice
        self.source: Optional[Any] = None  # the loader of the pass being read
        self._carry: Optional[Any] = None  # live samples read, not trained yet
        self._credit = 0.0  # slices owed by the refill rate, below one
        self.untrained_total = 0  # live samples read but never trained (the carry when a pass ended)

    def start(self, source: Any, carry: Optional[Any] = None) -> None:
        """A (new) pass over ``source``, with ``carry`` (live samples already read) trained first."""
        self.untrained()
        self.source, self._carry, self._credit = source, carry, 0.0

    def untrained(self) -> int:
        """Forget the carried live samples (the pass ended or the stream stops); returns (and logs) them."""
        n = 0 if self._carry is None else int(self._carry.labels.shape[0])
        if n:
            logger.info("input skipping: %d live sample(s) carried on this rank go untrained (the data pass or "
                        "scheduling off ended)", n)
        self._carry = None
        self.untrained_total += n
        return n

    def next(self, it: Iterator[Any], train_step: int) -> Any:
        """This rank's batch that trains at ``train_step``, read from ``it`` (this rank's slices);
        StopIteration when ``it`` is dry."""
        k, active = 1, self.hook.skipping(train_step)
        if active:
            self._credit += self.hook.refill_rate()
            k = int(self._credit)
            self._credit -= k
        slices: List[Any] = []
        for _ in range(k):
            try:
                batch = self.feature_order(next(it))
            except StopIteration:
                break
            self.size = self.size or int(batch.labels.shape[0])
            self.host.count_read(self.world * int(batch.labels.shape[0]))
            slices.append(batch)
        if not slices:
            self.untrained()
            raise StopIteration
        t0 = time.perf_counter()
        batch = self._assemble(slices, train_step)
        if active:  # the classifier ran: its time (reading excluded)
            self.hook.count_cost(time.perf_counter() - t0)
        return batch

    def _assemble(self, slices: List[Any], train_step: int) -> Any:
        """The step's batch from the carry and ``slices``: live samples first, topped up with stale ones;
        a surplus carried."""
        carry, self._carry = self._carry, None
        parts = ([carry] if carry is not None else []) + slices
        # per sample of the carry then the slices: stale (dropped), and its lookups
        drop, lookups = [], []
        for b in parts:
            n_b = int(b.labels.shape[0])
            verdict = self.hook.classify_inputs(self.host, b, train_step) if b is not carry else None
            drop.append(verdict[0] if verdict is not None else torch.zeros(n_b, dtype=torch.bool))
            lookups.append(verdict[1] if verdict is not None else torch.zeros(n_b, dtype=torch.int64))
        stale = torch.cat(drop)
        live_idx, stale_idx = (~stale).nonzero().flatten(), stale.nonzero().flatten()
        n = live_idx.numel()
        if n < self.size:  # top up with stale samples (they train)
            extra = min(self.size - n, stale_idx.numel())
            take, keep_idx, skipped = torch.cat([live_idx, stale_idx[:extra]]), live_idx[:0], stale_idx[extra:]
        else:
            cut = max(self.size, n - self.size)  # carry at most one slice
            take, keep_idx, skipped = live_idx[:cut], live_idx[cut:], stale_idx
        self.hook.count_dropped(self.host, torch.cat(lookups)[skipped])
        pool = concat_samples(parts)
        if keep_idx.numel():
            self._carry = select_samples(pool, keep_idx)
        if not stale_idx.numel() and not keep_idx.numel():  # every sample trains, in order
            return pool
        return select_samples(pool, take)
