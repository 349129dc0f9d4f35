"""``pipeline.scheduling=off|auto``: herald's scheduling only where it pays, in a room of its own.

Off means hot replication alone, run as it then runs: under TorchRec's own ``TrainPipelineSparseDist``
(its input dist overlapped with compute), fed this rank's samples. ``auto`` times ``probe_steps`` steps
with scheduling on, then ``probe_steps`` with it off, each after ``probe_steps // 2`` unmeasured ones;
the off phase's TorchRec pipeline is fed exactly the probe's batches and drained before the decision, so
whichever mode wins, every batch trains once, in order. The slowest rank's mean decides, so every rank
makes the same choice. :class:`SchedulingSwitch` owns the probe, the decision and TorchRec's pipeline;
the herald pipeline asks it before each step which mode trains.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from torchrec_herald.dist_utils import collective_device
from torchrec_herald.pipeline.context import SchedulerStats
from torchrec_herald.pipeline.options import probe_mode_steps

__all__ = ["ON_MARGIN", "SPARSE_DIST_AHEAD", "SchedulingSwitch", "SwitchHost"]

logger = logging.getLogger(__name__)

#: batches ``TrainPipelineSparseDist`` holds beyond the one it trains (input dist started, copied)
SPARSE_DIST_AHEAD = 2
#: how much shorter scheduling's probed step must be for ``auto`` to keep it on (see ``decide``)
ON_MARGIN = 0.03


class SwitchHost(Protocol):
    """What the switch needs of the herald pipeline it switches."""

    mode: str
    stats: SchedulerStats
    global_batches: Optional[bool]

    def enter_mode(self, mode: str) -> None:
        """Train in ``mode`` from the next step (``on``: the configured scheduling; ``off``: hot replication
        alone); leaving the plan flushes it."""

    def settle(self) -> None:
        """Take the run-ahead thread's batch into the window and flush the plan (the model then is in
        herald's stock layout)."""

    def take_window_batches(self) -> List[Batch]:
        """This rank's batches in the window, oldest first, the window emptied."""

    def stop_collecting_reads(self) -> None:
        """Scheduling is off for good: batches entering the window no longer need every rank's reads."""

    def off_stream(self, it: Iterator[Batch], first_step: int) -> Iterator[Batch]:
        """This rank's batches from ``it`` for TorchRec's pipeline, the first training at ``first_step``."""


class _Feed:
    """``source``'s items, at most ``limit`` of them (None: all), a limit that can be set again (an ``islice``
    whose end moves: an eval pass changes which batches TorchRec's pipeline holds in flight)."""

    def __init__(self, source: Iterator[Any], limit: Optional[int]) -> None:
        self._source, self._left = source, limit

    def __iter__(self) -> "_Feed":
        return self

    def __next__(self) -> Any:
        if self._left is not None:
            if self._left <= 0:
                raise StopIteration
            self._left -= 1
        return next(self._source)

    def limit_to(self, n: int) -> None:
        """At most ``n`` more items (none where it had no limit)."""
        if self._left is not None:
            self._left = max(0, int(n))


class SchedulingSwitch:
    """``off`` or ``auto`` scheduling of one herald pipeline.

    Args:
        host: the herald pipeline (:class:`SwitchHost`).
        setting: ``off`` or ``auto``.
        probe_steps: ``auto``: timed steps per mode.
        make_delegate: builds TorchRec's pipeline that trains hot replication alone.
        pg, world, rank: the process group the decision is agreed on, and this rank's place in it.
    """

    def __init__(self, host: SwitchHost, setting: str, probe_steps: int,
                 make_delegate: Callable[[], TrainPipelineSparseDist], pg: Optional[dist.ProcessGroup], world: int,
                 rank: int, device_sync: Optional[Callable[[], None]] = None) -> None:
        if setting not in ("off", "auto"):
            raise ValueError(f"SchedulingSwitch handles pipeline.scheduling=off|auto, got {setting!r}")
        self.host, self.setting, self.probe_steps = host, setting, int(probe_steps)
        self._make_delegate, self._pg, self._world, self._rank = make_delegate, pg, world, rank
        self.probe: Optional[Dict[str, Any]] = (
            {"seconds": {"on": 0.0, "off": 0.0}, "steps": {"on": 0, "off": 0}, "decided": False}
            if setting == "auto" else None)
        self._step_started: Optional[float] = None
        #: waits for the device's queued work (None: the host's clock is the step's, as on a CPU)
        self._device_sync = device_sync
        self._delegate: Optional[TrainPipelineSparseDist] = None
        self._delegate_src: Optional[Iterator[Batch]] = None
        self._delegate_it: Optional[Iterator[Batch]] = None
        self._evaluating = False  # an eval pass through TorchRec's pipeline began (eval_in_flight)

    # ------------------------------------------------------------------ the probe
    def _phase(self, step: int) -> Tuple[str, bool]:
        """(mode, timed) of ``step`` in the probe: ``w`` unmeasured then ``p`` timed steps with scheduling
        on, then the same with it off under TorchRec's pipeline, plus the steps that drain the batches it
        holds ahead (``p = probe_steps``, ``w = p // 2``). Both modes are timed as they would then run."""
        w, mode_steps = self.probe_steps // 2, probe_mode_steps(self.probe_steps)
        if step < mode_steps:
            return "on", step >= w
        return "off", w <= step - mode_steps < mode_steps

    def probe_length(self) -> int:
        """Steps the probe runs: ``2 · (w + p)`` and the off mode's drain."""
        return 2 * probe_mode_steps(self.probe_steps) + SPARSE_DIST_AHEAD

    def before_step(self) -> None:
        """Time the previous step into its mode; switch modes on the probe's schedule; after the probe,
        keep the mode :meth:`decide` picks (the slowest rank's mean step time decides, the same on every
        rank)."""
        probe, step = self.probe, self.host.stats.steps
        if probe is None or probe["decided"]:
            return
        now = self._clock(step)
        self._time_step_ended(now)
        self._step_started = now
        if step < self.probe_length():
            want = self._phase(step)[0]
            if want != self.host.mode:
                self._switch(want)
            return
        means = torch.tensor([probe["seconds"][m] / max(probe["steps"][m], 1) for m in ("on", "off")],
                             dtype=torch.float64, device=collective_device(self._pg))  # (a user's NCCL-only group)
        dist.all_reduce(means, op=dist.ReduceOp.MAX, group=self._pg)
        on_ms, off_ms = (1000 * float(x) for x in means)
        probe.update(decided=True, on_ms_per_step=on_ms, off_ms_per_step=off_ms)
        self.drop_delegate()  # the probe's delegate trained exactly its share of batches: it is empty
        best = self.decide(on_ms, off_ms)
        logger.info("pipeline.scheduling=auto: %.1f ms/step with scheduling on, %.1f with it off (hot replication "
                    "alone) -> %s%s", on_ms, off_ms, best, self.why(on_ms, off_ms, best))
        if best != self.host.mode:
            self._switch(best)
        if best == "off":  # for good: the window's batches no longer need every rank's reads
            self.host.stop_collecting_reads()

    @staticmethod
    def why(on_ms: float, off_ms: float, best: str) -> str:
        """The reason the probe's log line gives for ``best``: off where scheduling cost time, or where it saved less
        than :data:`ON_MARGIN` (a near tie goes to the mode with no scheduler)."""
        if best == "on":
            return ""
        if on_ms >= off_ms:
            return ": scheduling costs more time than it saves on this link and machine"
        return (f": scheduling saved {100 * (1 - on_ms / off_ms):.1f} %, under the {100 * ON_MARGIN:.0f} % it must "
                f"save to stay on (a near tie goes to the mode with no scheduler)")

    @staticmethod
    def decide(on_ms: float, off_ms: float) -> str:
        """The mode ``auto`` keeps: scheduling on where its mean step is shorter by at least
        :data:`ON_MARGIN`, else hot replication alone. A near tie goes to the mode with no scheduler
        thread: its cost is the one other work on the rank's cores makes grow (measured on 2 shared cores
        at 200 Mbit/s: a 2 % win for scheduling in the probe, then 1.67× stock where off trains 1.92×)."""
        return "on" if on_ms < (1.0 - ON_MARGIN) * off_ms else "off"

    def _switch(self, mode: str) -> None:
        """Change mode between steps (every rank at the same step)."""
        if mode == "on":
            self.drop_delegate()
        self.host.enter_mode(mode)

    # ------------------------------------------------------------------ scheduling off
    def progress_off(self, it: Iterator[Batch]) -> Any:
        """One step of hot replication alone under TorchRec's ``TrainPipelineSparseDist``: first the
        window's batches (this rank's share, already read), then this rank's slice of each global batch.
        While ``auto`` probes, it is fed exactly the batches of the probe's remaining steps, so it is empty
        when the probe decides (whichever mode wins, no batch is skipped or trained twice)."""
        if self._delegate is None:
            self.host.settle()
            self._delegate = self._make_delegate()
        probing = self.probe is not None and not self.probe["decided"]
        # (each of the probe's remaining steps trains one batch: one TorchRec's pipeline holds in flight, else one
        # the feed gives)
        remaining = self.probe_length() - self.host.stats.steps - self.batches_in_flight() if probing else None
        if self._delegate_src is not it:
            queued = self.host.take_window_batches()
            share = self._my_share(queued, it, self.host.stats.steps)
            self._delegate_src, self._delegate_it = it, _Feed(share, remaining)
        elif self._evaluating and isinstance(self._delegate_it, _Feed) and remaining is not None:
            # (an eval pass evaluated batches in flight and queued its own behind them, which train: stock
            # TorchRec's semantics)
            self._delegate_it.limit_to(remaining)
        self._evaluating = False
        try:
            out = self._delegate.progress(self._delegate_it)
        except BaseException:  # (the data's end, or a batch that raised: it ended the generators feeding TorchRec's
            self._delegate_src = self._delegate_it = None  # pipeline, so the next progress() starts new ones)
            raise
        self.host.stats.steps += 1
        return out

    def _my_share(self, queued: List[Any], it: Iterator[Batch], first_step: int) -> Iterator[Batch]:
        """The window's batches, then this rank's batches from ``it`` (:meth:`SwitchHost.off_stream`);
        the first yielded trains at ``first_step``."""
        yield from queued
        yield from self.host.off_stream(it, first_step + len(queued))

    def batches_in_flight(self) -> int:
        """The batches TorchRec's pipeline holds ahead (their input dists started)."""
        return len(getattr(self._delegate, "batches", None) or ())

    def eval_in_flight(self, it: Iterator[Any]) -> Any:
        """An eval step while TorchRec's pipeline holds training batches in flight: its own step, forward only
        (TorchRec's semantics: the batches in flight first, then ``it``'s; a pass stopped early leaves eval batches
        in flight, which then train). The next training step sets a probe's feed to what its remaining steps then
        need, and the eval's time is no probe step's."""
        assert self._delegate is not None
        self._evaluating = True
        self.stop_clock()
        try:
            return self._delegate.progress(it)
        finally:
            self.stop_clock()

    def stop_clock(self) -> None:
        """The step that just trained ends now: timed into its mode up to here (on a GPU, its queued work waited for
        where a timed span ends), and the time until the next step is no step's (an eval pass, or another run's turn
        in the same ranks, follows)."""
        if self.probe is not None and not self.probe["decided"]:
            self._time_step_ended(self._clock(None))
        self._step_started = None

    def _clock(self, starting: Optional[int]) -> float:
        """The time now, as the probe reads it between steps (``starting``: the step about to start; None: none
        follows in this run's turn). On a GPU the host runs ahead of the device's queue, so where a timed span of
        steps of one mode begins or ends, the device's queued work is waited for first: a span's time is then the
        device's, with host and device overlapping inside it as they do in training (one wait at each end, not one
        a step)."""
        if self._device_sync is not None and self._span_edge(starting):
            self._device_sync()
        return time.perf_counter()

    def _span_edge(self, starting: Optional[int]) -> bool:
        """Between the step that trained last and ``starting``, a timed span begins or ends."""
        done = self.host.stats.steps - 1
        ended = self._phase(done) if done >= 0 and self._step_started is not None else None
        begins = self._phase(starting) if starting is not None and starting < self.probe_length() else None
        if ended is not None and begins is not None and ended == begins:
            return False  # (inside a span, or between untimed steps of one mode)
        return bool((ended and ended[1]) or (begins and begins[1]))

    def _time_step_ended(self, now: float) -> None:
        """The step that trained last ended at ``now``: its time since it started into its mode's sum, where the
        probe times it (its start unknown after an eval pass: untimed)."""
        probe, started, step = self.probe, self._step_started, self.host.stats.steps
        assert probe is not None
        if started is not None and step >= 1:
            mode, timed = self._phase(step - 1)
            if timed:
                probe["seconds"][mode] += now - started
                probe["steps"][mode] += 1

    def pause_delegate(self) -> None:
        """Hand the model's own forwards back for a while (an eval pass): TorchRec's pipeline keeps its batches
        in flight and re-attaches itself at its next ``progress``."""
        if self._delegate is not None:
            self._delegate.detach()

    def drop_delegate(self) -> None:
        """Detach and forget TorchRec's pipeline (it holds no batch between phases of the probe)."""
        if self._delegate is not None:
            self._delegate.detach()
            self._delegate = None
        self._delegate_src = self._delegate_it = None

    def restore(self, probe: Optional[Dict[str, Any]]) -> None:
        """A checkpoint's probe (its clock restarts at the next step)."""
        self.probe = probe
        self._step_started = None

    def report(self) -> Dict[str, Any]:
        """``metrics.json`` ``herald_pipeline.scheduling``: the probe's figures (for ``auto``)."""
        if self.probe is None:
            return {}
        out = {k: v for k, v in self.probe.items() if k in ("decided", "on_ms_per_step", "off_ms_per_step")}
        if not self.probe["decided"]:  # (a run shorter than the probe: nothing was chosen)
            out["why"] = (f"pipeline.scheduling=auto: the run ended before its probe's {self.probe_length()} steps "
                          f"(pipeline.probe_steps={self.probe_steps}) decided; no choice was made")
        return out
