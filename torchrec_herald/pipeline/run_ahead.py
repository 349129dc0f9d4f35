"""The run-ahead worker: one thread that schedules the next batch entering herald's window (read, keys,
allocation, reads) and plans the next step while the current step trains, as the released Herald runs
its scheduler in a thread beside training (docs/design.md §3). At most one job is in flight; the step
collects it before it needs its plan, waiting only when the thread is late, and may submit the next job at
once (the pipeline chains them: the plan of the step after next is made while this step finishes)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional, Tuple

from torchrec_herald.pipeline.context import RUN_AHEAD_THREAD
from torchrec_herald.traffic import TrafficMeter

__all__ = ["RunAhead"]

logger = logging.getLogger(__name__)


class RunAhead:
    """A one-thread worker with at most one job in flight."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(1, RUN_AHEAD_THREAD)
        self._pending: Optional[Future] = None

    @property
    def busy(self) -> bool:
        """A job was submitted and not collected yet."""
        return self._pending is not None

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        """Run ``job(*args)`` on the worker; its collectives count in the traffic meters counting here now (the
        step's), however long it runs."""
        assert self._pool is not None and self._pending is None
        self._pending = self._pool.submit(TrafficMeter.counted_here(job), *args)

    def collect(self) -> Tuple[Any, float]:
        """The job's result (its errors are raised here) and the seconds waited for it; ``(None, 0.0)``
        with no job in flight."""
        if self._pending is None:
            return None, 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        result = pending.result()
        return result, time.perf_counter() - t0

    def wait_finished(self) -> float:
        """Wait until the job in flight (if any) has finished, leaving its result for :meth:`collect`; the seconds
        waited."""
        t0 = time.perf_counter()
        if self._pending is not None:
            wait([self._pending])
        return time.perf_counter() - t0

    def cancel(self) -> Any:
        """Wait for the job in flight and hand back its result for the caller to drop (None where it raised:
        its error is dropped too), or None with no job in flight."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                return pending.result()
            except Exception:  # noqa: BLE001 - the result is dropped; a restarted window re-reads the batch
                logger.debug("dropped run-ahead job raised", exc_info=True)
        return None

    def shutdown(self) -> None:
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
