"""One model of a training step's time: the planner picks a plan with it, the trainer reports it next to the
measured step, and ``benchmarks/time_model.py`` validates it on measured runs and projects it to 8–128 GPUs.

A candidate plan asks of each rank per step (:class:`PlanLoad`): bytes on the step's critical path (the
embedding exchanges, and DDP's dense all-reduce, which waits at the end of backward), bytes sent while
compute runs (herald's forward-ordered dense sync), collectives, lookups that pay herald's extra per-lookup
work, and scheduler time on the path. :class:`StepTimeModel` turns that into milliseconds:

    step = max( compute + extra + scheduler + critical_bytes / rate + collectives · latency + peer_wait,
                (critical_bytes + overlapped_bytes) / rate + collectives · latency,
                host_bound )                                      ranks sharing a host's cores

where an all-reduce's bytes cross at the link's all-reduce rate and the others' (the all-to-alls) at its
all-to-all rate (:class:`~torchrec_herald.planner.pricing.LinkModel`: a transport can give the two kinds different
shares of one link; the start-up probe times both). The overlapped bytes are all-reduces (herald's forward-ordered
dense sums). Where ranks share a host's cores, each all-reduce call also costs ``allreduce_call_ms`` (its ring's
steps wait for cores; 0 with a core or GPU per rank, as the planner prices).

The second term (``link_busy``) is the link's part of the step: the overlapped bytes (herald's forward-ordered dense
sums) hide behind compute alone, since they share the link with the critical collectives, so where compute cannot
cover their transfer they lengthen the step by the rest (``path + max(0, overlapped / rate − compute − extra)``, and
each overlapped all-reduce call's ``allreduce_call_ms`` where ranks share cores).

A plan's measured wait for late peers (:attr:`PlanLoad.peer_wait_ms`: a rank reaching a collective before its
slowest peer waits for it) adds to the critical path's communication, not to ``link_busy``: where the link is the
bottleneck the model assumes the peers' lateness hides behind its transfers (a late peer can leave it idle too).
The planner, deciding before any step, has none.

``compute`` is the step's compute on this device (measured; 0 when unknown, as in the planner, which decides
before any step: the predictions then compare the plans' link and extra work, and herald's forward-ordered sums
hide behind its extra work alone, a bias toward the stock plans). ``host_bound`` is the step
when the ranks of one host share its cores (a measured floor: 4 ranks on this machine's 2 cores; 0 on a
GPU cluster).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from torchrec_herald.comm import ring_allreduce_bytes
from torchrec_herald.planner.pricing import HERALD_COLLECTIVES, STOCK_TW_COLLECTIVES, LinkModel

__all__ = ["LinkDecision", "MIXABLE_STOCK", "PLAN_LABELS", "PlanLoad", "StepPrediction", "StepTimeModel", "choose_plan",
           "decide", "default_plan_margin", "default_plan_load", "mixed_plan_load", "per_table_choice", "step_ms"]


@dataclass(frozen=True)
class PlanLoad:
    """What one candidate plan asks of one rank per step.

    Attributes:
        name: ``herald``, ``table_wise`` or ``default`` (TorchRec's own plan), or any label.
        critical_bytes: bytes this rank sends on the step's critical path.
        overlapped_bytes: bytes it sends while compute runs (they cost time only where compute cannot cover them).
        collectives: collectives on the critical path (each costs one latency beyond its bytes).
        lookups: this rank's lookups that pay herald's extra per-lookup work (0 for stock plans).
        scheduler_ms: herald's scheduler time on the critical path.
        compute_ms: this plan's own compute when measured (default: the model's ``compute_ms``).
        host_bound_ms: the step when ranks share a host's cores (0: a core or GPU per rank).
        allreduce_bytes: of ``critical_bytes``, those all-reduces send (DDP's dense sum, DATA_PARALLEL tables', herald's
            dense hot-row sync); ``overlapped_bytes`` are all all-reduce bytes.
        allreduce_calls / overlapped_calls: the all-reduce calls on the critical path / overlapped (each costs the
            model's ``allreduce_call_ms``).
        peer_wait_ms: what the rank waits per step for its latest peer to reach each collective, beyond its own
            compute (measured: ranks' compute varies from step to step, and each collective waits for the slowest;
            0: not measured, as in the planner, which decides before any step).
    """

    name: str
    critical_bytes: float
    overlapped_bytes: float = 0.0
    collectives: float = 0.0
    lookups: float = 0.0
    scheduler_ms: float = 0.0
    compute_ms: Optional[float] = None
    host_bound_ms: float = 0.0
    allreduce_bytes: float = 0.0
    allreduce_calls: float = 0.0
    overlapped_calls: float = 0.0
    peer_wait_ms: float = 0.0


@dataclass(frozen=True)
class StepPrediction:
    """One candidate's predicted step, ms per rank: ``step = max(compute + extra + comm, link_busy, host)``, where
    ``link_busy`` is every byte's transfer and the critical collectives' latencies (the module's docstring)."""

    name: str
    compute_ms: float
    extra_ms: float
    comm_ms: float
    link_busy_ms: float
    step_ms: float

    def as_dict(self) -> Dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k != "name"}


def step_ms(compute_ms: float, extra_ms: float, comm_ms: float, link_busy_ms: float, host_bound_ms: float = 0.0
            ) -> float:
    """The model's step: the critical path, or the link's occupancy, or the host floor, whichever is longest."""
    return max(compute_ms + extra_ms + comm_ms, link_busy_ms, host_bound_ms)


@dataclass(frozen=True)
class StepTimeModel(LinkModel):
    """Milliseconds per step for a rank's link and device: the link's prices (:class:`LinkModel`: rate,
    per-collective latency, herald's extra work per lookup) plus the step's compute.

    Args:
        compute_ms: the step's compute on this device with the stock plan (0: unknown).
        allreduce_call_ms: what each all-reduce call costs beyond its bytes and one latency where ranks share a
            host's cores (0: a core or GPU per rank).
    """

    compute_ms: float = 0.0
    allreduce_call_ms: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("compute_ms", "allreduce_call_ms"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")

    @classmethod
    def on(cls, link: LinkModel) -> "StepTimeModel":
        """The model for ``link``'s prices with no compute measured (the candidates then differ only in
        their link and extra work)."""
        return cls(**{f.name: getattr(link, f.name) for f in fields(LinkModel)})  # (every price the link has)

    def predict(self, load: PlanLoad) -> StepPrediction:
        compute = self.compute_ms if load.compute_ms is None else load.compute_ms
        extra = self.lookups(load.lookups) + load.scheduler_ms
        comm = (self.transfer_ms(load.critical_bytes, load.allreduce_bytes) + self.collectives(load.collectives)
                + self.allreduce_call_ms * load.allreduce_calls + load.peer_wait_ms)  # (a late peer holds the path,
        # not the link: link_busy leaves it out)
        # (the critical path, the overlapped transfers hidden behind its compute alone: :data:`__doc__`)
        busy = (self.transfer_ms(load.critical_bytes + load.overlapped_bytes, load.allreduce_bytes + load.overlapped_bytes)
                + self.collectives(load.collectives)
                + self.allreduce_call_ms * (load.allreduce_calls + load.overlapped_calls))
        return StepPrediction(load.name, compute, extra, comm, busy, step_ms(compute, extra, comm, busy, load.host_bound_ms))


#: what each candidate plan is called in the decision, the printed table and ``metrics.json``
PLAN_LABELS = {"herald": "herald's plan", "table_wise": "stock TABLE_WISE", "default": "TorchRec's default plan",
               "mixed": "herald's tables beside stock ones (per table)"}


@dataclass(frozen=True)
class LinkDecision:
    """The plan the model of time chose (``herald``, ``table_wise``, ``default``: TorchRec's default plan, or
    ``mixed``: herald's tables beside stock ones, :attr:`per_table`), with every candidate's predicted per-rank
    step."""

    chosen: str
    predictions: Dict[str, StepPrediction]
    link_mbit: float
    #: the per-table candidate's pick: table -> ``herald`` or the stock sharding type it keeps
    per_table: Dict[str, str] = field(default_factory=dict)
    #: why the fastest prediction was not chosen ('' where it was): :func:`default_plan_margin`
    note: str = ""
    #: the rate all-reduces were priced at, where the link was given one apart (None: ``link_mbit``)
    allreduce_mbit: Optional[float] = None

    @property
    def herald(self) -> bool:
        """Herald's sharding trains (all tables, or those the per-table candidate gave it)."""
        return self.chosen in ("herald", "mixed")

    @property
    def stock_ms(self) -> float:
        """Stock TABLE_WISE's predicted step."""
        return self.predictions["table_wise"].step_ms

    @property
    def herald_ms(self) -> float:
        """Herald's plan's predicted step."""
        return self.predictions["herald"].step_ms

    def describe_per_table(self) -> str:
        """``N herald tables, M stock (type: tables, ...)`` for the per-table candidate ('' without one)."""
        if not self.per_table:
            return ""
        stock: Dict[str, List[str]] = {}
        for t, kind in self.per_table.items():
            if kind != "herald":
                stock.setdefault(kind, []).append(t)
        n = sum(k == "herald" for k in self.per_table.values())
        return f"{n} herald tables, stock " + "; ".join(f"{k}: {', '.join(ts)}" for k, ts in sorted(stock.items()))

    def describe(self) -> str:
        parts = ", ".join(f"{PLAN_LABELS.get(n, n)} {p.step_ms:.1f} ms" for n, p in self.predictions.items())
        verdict = PLAN_LABELS.get(self.chosen, self.chosen) + ("" if self.herald else (
            " with DDP (herald's replication, scheduling and forward-ordered dense sync cannot pay on this link)"))
        if self.chosen == "mixed":
            verdict += f" ({self.describe_per_table()})"
        if self.note:
            verdict += f"; {self.note}"
        if self.is_local:
            return (f"one rank, no link (no embedding leaves the rank, so herald's plan saves nothing): predicted "
                    f"step cost (herald's extra work) {parts} -> {PLAN_LABELS.get(self.chosen, self.chosen)}")
        ar = "" if self.allreduce_mbit is None else f" ({self.allreduce_mbit:g} for all-reduces)"
        return (f"link {self.link_mbit:g} Mbit/s{ar}: predicted step cost per rank (link, collectives, herald's extra "
                f"work) {parts} -> {verdict}")

    @property
    def is_local(self) -> bool:
        """Decided for one rank, on its local "link" (:meth:`~torchrec_herald.planner.pricing.LinkModel.local`)."""
        return math.isinf(self.link_mbit)

    def as_dict(self) -> Dict[str, Any]:
        return {"herald": self.herald, "chosen": self.chosen, "predicted_stock_ms": self.stock_ms,
                "predicted_herald_ms": self.herald_ms, "link_mbit": None if self.is_local else self.link_mbit,
                "allreduce_mbit": self.allreduce_mbit,
                "one_rank": self.is_local, "text": self.describe(),
                "predicted": {n: p.as_dict() for n, p in self.predictions.items()}, "per_table": dict(self.per_table),
                "note": self.note}


def choose_plan(loads: Iterable[PlanLoad], model: StepTimeModel, per_table: Optional[Mapping[str, str]] = None
                ) -> LinkDecision:
    """The load with the shortest predicted step (ties: the earlier one), except that TorchRec's default plan
    (``default``) is chosen over stock TABLE_WISE only where it is predicted faster by more than one
    collective's latency (else the fastest of the other candidates): :func:`default_plan_margin`.
    ``per_table``: the ``mixed`` candidate's pick per table, carried into the decision."""
    loads = list(loads)
    if not loads:
        raise ValueError("choose_plan needs at least one candidate")
    preds: Dict[str, StepPrediction] = {ld.name: model.predict(ld) for ld in loads}
    order: List[str] = [ld.name for ld in loads]

    def fastest(names: List[str]) -> str:
        return min(names, key=lambda n: (preds[n].step_ms, order.index(n)))

    best, note = fastest(order), ""
    if best == "default" and "table_wise" in preds and \
            preds["table_wise"].step_ms - preds["default"].step_ms <= default_plan_margin(model):
        best = fastest([n for n in order if n != "default"])
        note = (f"TorchRec's default plan is predicted within one collective's latency "
                f"({default_plan_margin(model):.2f} ms) of stock TABLE_WISE, closer than the model can tell; "
                f"its extra sharding kinds compute more beside the link than the model prices")
    return LinkDecision(best, preds, model.link_mbit, dict(per_table or {}) if "mixed" in preds else {}, note,
                        model.allreduce_mbit)


def default_plan_margin(model: LinkModel) -> float:
    """How much faster than stock TABLE_WISE TorchRec's default plan must be predicted to be chosen: one
    collective's latency. Its plan runs more sharding kinds than TABLE_WISE (DATA_PARALLEL tables beside
    TABLE_WISE and ROW_WISE ones, each kind its own lookup module, kernels and collectives), whose compute
    beside the link the model does not price. Measured at 4 ranks on this 2-core CPU host, loopback, runs
    interleaved (``benchmarks/step_time_cpu.py --world-size 4 --steps 150 --warmup 30 planner=stock``, and
    ``planner=table_wise``): 36.3 and 40.7 ms a step against TABLE_WISE's 30.1 and 34.7, each rank's process
    CPU 18-21 ms a step against 15-17. The model had put the two within 0.2 ms of each other in five of six
    recorded 4-rank runs on an unlimited link, less than the probe's latency there (0.4-0.8 ms), and picked
    either from run to run."""
    return model.collective_latency_ms


def decide(expected: Iterable[Mapping[str, float]], world_size: int, model: LinkModel, *,
           dense_bytes: float = 0.0, dense_sync: str = "forward_ordered",
           default_plan: Optional[PlanLoad] = None, mixed: Optional[Tuple[PlanLoad, Mapping[str, str]]] = None
           ) -> LinkDecision:
    """Choose among herald's plan, stock TABLE_WISE and (when given) TorchRec's default plan on
    ``model``'s link, by predicted step time (``planner/time_model.py``).

    Args:
        expected: per herald table, the planner's expected traffic (``HotSpec.expected``: ``lookups``,
            ``stock_table_wise`` and ``herald_total`` bytes per step, all ranks).
        world_size: W.
        dense_bytes: bytes each rank sends per step to all-reduce the dense layers (the same for every
            plan; on the critical path under DDP, overlapped under herald's forward-ordered sync).
        dense_sync: herald's dense sync (``forward_ordered`` or ``ddp``).
        default_plan: TorchRec's default plan's load, a third candidate.
        mixed: the per-table candidate (:func:`mixed_plan_load`) and its pick per table, a fourth: chosen
            only where it is predicted faster than the three whole plans (ties go to them), or than the two
            besides TorchRec's default plan where that one is set aside (:func:`choose_plan`).
    """
    expected = list(expected)
    lookups = sum(e.get("lookups", 0.0) for e in expected) / world_size
    stock_bytes = sum(e.get("stock_table_wise", 0.0) for e in expected) / world_size
    herald_bytes = sum(e.get("herald_total", 0.0) for e in expected) / world_size
    hot_sync_ar = sum(e.get("herald_hot_sync_allreduce", 0.0) for e in expected) / world_size
    overlapped = overlapped_dense_bytes(dense_bytes, dense_sync)
    loads = [PlanLoad("herald", herald_bytes + dense_bytes - overlapped, overlapped, HERALD_COLLECTIVES, lookups,
                      allreduce_bytes=hot_sync_ar + dense_bytes - overlapped),
             PlanLoad("table_wise", stock_bytes + dense_bytes, 0.0, STOCK_TW_COLLECTIVES, allreduce_bytes=dense_bytes)]
    if default_plan is not None:
        loads.append(default_plan)
    if mixed is not None:
        loads.append(mixed[0])
    return choose_plan(loads, StepTimeModel.on(model), mixed[1] if mixed is not None else None)


def default_plan_load(sharding_types: Mapping[str, str], expected: Mapping[str, Mapping[str, float]],
                      table_bytes: Mapping[str, float], world_size: int, dense_bytes: float) -> PlanLoad:
    """TorchRec's default plan as a :class:`~torchrec_herald.planner.time_model.PlanLoad`: per table the
    bytes of its sharding type (TABLE_WISE and its variants as TABLE_WISE, ROW_WISE as ROW_WISE, a
    DATA_PARALLEL table's gradient all-reduce), every rank's share, plus the dense all-reduce under DDP;
    the input and output all-to-alls of each sharded type and one all-reduce for the data-parallel tables.
    """
    W = world_size
    total, kinds, allreduce = 0.0, set(), 0.0
    for name, st in sharding_types.items():
        e = expected.get(name, {})
        if st == "data_parallel":
            allreduce += ring_allreduce_bytes(table_bytes.get(name, 0.0), W) * W  # all ranks
            kinds.add("data_parallel")
        elif st == "row_wise":
            total += e.get("stock_row_wise", 0.0)
            kinds.add(st)
        else:
            total += e.get("stock_table_wise", 0.0)
            kinds.add("table_wise" if st in ("table_wise", "column_wise", "table_row_wise") else st)
    collectives = sum(1 if k == "data_parallel" else STOCK_TW_COLLECTIVES for k in kinds)
    return PlanLoad("default", (total + allreduce) / W + dense_bytes, 0.0, collectives,
                    allreduce_bytes=allreduce / W + dense_bytes)


#: stock sharding types a table may keep beside herald's tables in one EBC (sharding/mixed.py's
#: MIXABLE_STOCK_TYPES, tested equal); a table the default plan makes DATA_PARALLEL is offered as
#: TABLE_WISE (a fully hot herald table is its replication)
MIXABLE_STOCK = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")


def _stock_kind(sharding_type: str) -> str:
    return sharding_type if sharding_type in MIXABLE_STOCK else "table_wise"


def _stock_bytes(kind: str, e: Mapping[str, float]) -> float:
    return e.get("stock_row_wise", 0.0) if kind == "row_wise" else e.get("stock_table_wise", 0.0)


def per_table_choice(expected: Mapping[str, Mapping[str, float]], stock_types: Mapping[str, str], world_size: int,
                     model: LinkModel, dense_bytes: float = 0.0, dense_sync: str = "forward_ordered") -> Dict[str, str]:
    """Per table, ``herald`` or the stock sharding type it keeps (the fewer bytes of its type in TorchRec's
    default plan and TABLE_WISE; TABLE_WISE for DATA_PARALLEL).

    The tables are ranked by the link time herald saves per lookup (its dense hot-row sync at the link's
    all-reduce rate, the rest at its all-to-all rate); herald takes the first k of them, for the
    k whose whole candidate (:func:`mixed_plan_load`: bytes, both parts' collectives, herald's extra work
    per step, the link's occupancy) has the shortest predicted step on ``model``'s link. A table-by-table
    comparison would not do: herald's extra work is paid once per step, and where the link is busy all
    the step it hides under it."""
    W = world_size
    kinds = {n: min(("table_wise", _stock_kind(stock_types.get(n, "table_wise"))), key=lambda k: _stock_bytes(k, e))
             for n, e in expected.items()}
    timer = StepTimeModel.on(model)
    saving = {n: (timer.transfer_ms(_stock_bytes(kinds[n], e))
                  - timer.transfer_ms(e.get("herald_total", 0.0), e.get("herald_hot_sync_allreduce", 0.0)))
              / max(e.get("lookups", 0.0), 1.0) for n, e in expected.items()}
    ranked = sorted(expected, key=lambda n: -saving[n])
    best: Dict[str, str] = {}
    best_ms = float("inf")
    for k in range(len(ranked) + 1):
        pick = {n: ("herald" if i < k else kinds[n]) for i, n in enumerate(ranked)}
        ms = timer.predict(mixed_plan_load(expected, pick, W, dense_bytes, dense_sync)).step_ms
        if ms < best_ms or not best:  # (the first pick stands where every prediction overflows)
            best, best_ms = pick, ms
    return {n: best[n] for n in expected}


def overlapped_dense_bytes(dense_bytes: float, dense_sync: str) -> float:
    """The dense all-reduce's bytes that overlap compute: all of them under herald's forward-ordered sync (each
    group's sum waited for at its next forward), none under DDP's (waited for before the optimizer)."""
    return dense_bytes if dense_sync == "forward_ordered" else 0.0


def mixed_plan_load(expected: Mapping[str, Mapping[str, float]], pick: Mapping[str, str], world_size: int,
                    dense_bytes: float, dense_sync: str = "forward_ordered") -> PlanLoad:
    """The per-table candidate (``mixed``) as a :class:`PlanLoad`: the herald tables' bytes, the stock
    tables' bytes by their type, herald's collectives plus each stock type's input and output all-to-alls,
    the dense sync as herald runs it, and herald's extra work on **every** lookup of the EBC, as if all
    its tables were herald's: measured, that work is per step, not per table (W=2, 1000 Mbit/s, 2 cores:
    herald hot replication of all 26 tables computes 1.4 ms more per step than TABLE_WISE, a split of 5
    herald tables beside 21 TABLE_WISE ones 3.6 ms more; RESULTS.md "Per-table decisions, measured"). So
    a split pays only where its stock tables send fewer bytes than herald would for them."""
    W = world_size
    herald = [n for n, k in pick.items() if k == "herald"]
    crit = sum(expected[n].get("herald_total", 0.0) for n in herald)
    hot_sync_ar = sum(expected[n].get("herald_hot_sync_allreduce", 0.0) for n in herald)
    crit += sum(_stock_bytes(k, expected[n]) for n, k in pick.items() if k != "herald")
    kinds = {k for k in pick.values() if k != "herald"}
    overlapped = overlapped_dense_bytes(dense_bytes, dense_sync)
    collectives = (HERALD_COLLECTIVES if herald else 0) + STOCK_TW_COLLECTIVES * len(kinds)
    return PlanLoad("mixed", crit / W + dense_bytes - overlapped, overlapped, collectives,
                    sum(e.get("lookups", 0.0) for e in expected.values()) / W if herald else 0.0,
                    allreduce_bytes=hot_sync_ar / W + dense_bytes - overlapped)
