"""One model of a training step's time: the planner picks a plan with it, the trainer reports it next to the
measured step, and ``benchmarks/time_model.py`` validates it on measured runs and projects it to 8–128 GPUs.

A candidate plan asks of each rank per step (:class:`PlanLoad`): bytes on the step's critical path (the
embedding exchanges, and DDP's dense all-reduce, which waits at the end of backward), bytes sent while
compute runs (herald's forward-ordered dense sync), collectives, lookups that pay herald's extra per-lookup
work, and scheduler time on the path. :class:`StepTimeModel` turns that into milliseconds:

    step = max( compute + extra + scheduler + critical_bytes / rate + collectives · latency,
                (critical_bytes + overlapped_bytes) / rate,       the link is busy at most all the time
                host_bound )                                      ranks sharing a host's cores

``compute`` is the step's compute on this device (measured; 0 when unknown, then the predictions compare
the plans' link and extra work only, which is all that differs between them). ``host_bound`` is the step
when the ranks of one host share its cores (a measured floor: 4 ranks on this machine's 2 cores; 0 on a
GPU cluster).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional

__all__ = ["PlanChoice", "PlanLoad", "StepPrediction", "StepTimeModel", "choose_plan"]


@dataclass(frozen=True)
class PlanLoad:
    """What one candidate plan asks of one rank per step.

    Attributes:
        name: ``herald``, ``table_wise`` or ``default`` (TorchRec's own plan), or any label.
        critical_bytes: bytes this rank sends on the step's critical path.
        overlapped_bytes: bytes it sends while compute runs (they cost time only when the link is full).
        collectives: collectives on the critical path (each costs one latency beyond its bytes).
        lookups: this rank's lookups that pay herald's extra per-lookup work (0 for stock plans).
        scheduler_ms: herald's scheduler time on the critical path.
        compute_ms: this plan's own compute when measured (default: the model's ``compute_ms``).
        host_bound_ms: the step when ranks share a host's cores (0: a core or GPU per rank).
    """

    name: str
    critical_bytes: float
    overlapped_bytes: float = 0.0
    collectives: float = 0.0
    lookups: float = 0.0
    scheduler_ms: float = 0.0
    compute_ms: Optional[float] = None
    host_bound_ms: float = 0.0


@dataclass(frozen=True)
class StepPrediction:
    """One candidate's predicted step, ms per rank: ``step = max(compute + extra + comm, link_busy, host)``."""

    name: str
    compute_ms: float
    extra_ms: float
    comm_ms: float
    link_busy_ms: float
    step_ms: float

    def as_dict(self) -> Dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


@dataclass(frozen=True)
class StepTimeModel:
    """Milliseconds per step for a rank's link and device.

    Args:
        link_mbit: the rate a collective gets over this rank's link, Mbit/s (> 0).
        collective_latency_ms: time a collective costs beyond its bytes (>= 0).
        compute_ms: the step's compute on this device with the stock plan (0: unknown).
        cpu_us_per_lookup: herald's extra work per lookup over stock's fused kernels.
    """

    link_mbit: float
    collective_latency_ms: float
    compute_ms: float = 0.0
    cpu_us_per_lookup: float = 0.6

    def __post_init__(self) -> None:
        if not self.link_mbit > 0:
            raise ValueError(f"link_mbit must be > 0, got {self.link_mbit}")
        if self.collective_latency_ms < 0 or self.compute_ms < 0 or self.cpu_us_per_lookup < 0:
            raise ValueError("collective_latency_ms, compute_ms and cpu_us_per_lookup must be >= 0")

    def transfer_ms(self, nbytes: float) -> float:
        return nbytes * 8 / (self.link_mbit * 1e3)

    def predict(self, load: PlanLoad) -> StepPrediction:
        compute = self.compute_ms if load.compute_ms is None else load.compute_ms
        extra = load.lookups * self.cpu_us_per_lookup / 1e3 + load.scheduler_ms
        comm = self.transfer_ms(load.critical_bytes) + load.collectives * self.collective_latency_ms
        busy = self.transfer_ms(load.critical_bytes + load.overlapped_bytes)
        step = max(compute + extra + comm, busy, load.host_bound_ms)
        return StepPrediction(load.name, compute, extra, comm, busy, step)


@dataclass(frozen=True)
class PlanChoice:
    """The candidate with the shortest predicted step, and every candidate's prediction."""

    chosen: str
    predictions: Dict[str, StepPrediction]
    link_mbit: float
    reasons: Dict[str, str] = field(default_factory=dict)

    @property
    def herald(self) -> bool:
        return self.chosen == "herald"

    def predicted_ms(self, name: Optional[str] = None) -> float:
        return self.predictions[name or self.chosen].step_ms


def choose_plan(loads: Iterable[PlanLoad], model: StepTimeModel,
                reasons: Optional[Mapping[str, str]] = None) -> PlanChoice:
    """The load with the shortest predicted step (ties: the earlier one)."""
    loads = list(loads)
    if not loads:
        raise ValueError("choose_plan needs at least one candidate")
    preds: Dict[str, StepPrediction] = {ld.name: model.predict(ld) for ld in loads}
    order: List[str] = [ld.name for ld in loads]
    best = min(order, key=lambda n: (preds[n].step_ms, order.index(n)))
    return PlanChoice(best, preds, model.link_mbit, dict(reasons or {}))
