"""HeraldTrainPipeline's options (Herald's window, allocator and worker caches; HET's bounded staleness;
Slipstream's stale-update skipping) as one dataclass, validated once, with one error per bad value
naming its ``pipeline.*`` key.

It is also the ``pipeline=herald`` option of the Hydra config (``torchrec_herald/config.py`` registers
it), so the command line and the Python API start from the same defaults. Two of them depend on the
data loader the pipeline is given, and are decided by :meth:`HeraldPipelineConfig.resolve` when it is:
``global_batches`` (``None``: wherever possible) and ``scheduling=auto`` (probe where both modes can run,
else ``on``); ``run_ahead`` (``None``) is on whatever the loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from torchrec_herald.option_types import check_bool, check_int, check_real
from torchrec_herald.pipeline.stale_skip import SkipConfig

__all__ = ["ALLOCATORS", "CACHE_POLICIES", "GLOBAL_PLANNING_MAX_WORLD", "HeraldPipelineConfig", "PLANNING",
           "SCHEDULER_IMPLS", "SCHEDULING", "SYNC_MODES"]

#: ``pipeline.allocator`` values: ``auto`` = ``identity`` by home, ``greedy`` otherwise
ALLOCATORS = ("auto", "greedy", "identity")
#: ``pipeline.sync`` values: ``lazy`` = worker caches + the exact plan; ``eager`` = herald's own
#: per-step path (hot rows all-reduced every step, cold rows looked up at their owner)
SYNC_MODES = ("lazy", "eager")
#: ``pipeline.scheduling`` values: ``on`` = the allocator and ``sync`` as configured; ``off`` = hot
#: replication alone (samples stay where loaded, herald's per-step path); ``auto`` = time both on the
#: first steps and keep scheduling where it is the faster by ``auto_scheduling.ON_MARGIN`` (where every
#: rank agrees on each batch's samples, whole global batches or planning by home, and the plan is exact;
#: else ``on``)
SCHEDULING = ("on", "off", "auto")


def probe_mode_steps(probe_steps: int) -> int:
    """Steps ``scheduling=auto``'s probe runs in each mode: ``probe_steps // 2`` unmeasured, then
    ``probe_steps`` timed (:class:`~torchrec_herald.pipeline.auto_scheduling.SchedulingSwitch`)."""
    return probe_steps // 2 + probe_steps
#: ``pipeline.planning`` values: ``global`` = every rank plans every row (the same plan everywhere);
#: ``by_home`` = each rank plans the rows it is home to from the read keys sent to it
#: (``HomeSplitLazyPlanner``: per-rank work and metadata grow with its own reads, not with W·B);
#: ``auto`` = global up to :data:`GLOBAL_PLANNING_MAX_WORLD` ranks, by home beyond (:meth:`resolve_planning`)
PLANNING = ("auto", "global", "by_home")
#: ``planning=auto`` plans globally up to this many ranks: at W=2 and 50 Mbit/s, with every other key at
#: its default, global planning (with the input allocator) trained 3.96x stock TABLE_WISE, planning by
#: home 3.73x (medians of 5, benchmarks/RESULTS.md); global planning's per-rank cost grows with W·B
#: (0.33 s per rank-step at W=8), by home's with the rank's own reads
GLOBAL_PLANNING_MAX_WORLD = 2
#: ``allocator=auto`` where each rank loads its own batch (a moved sample is sent): samples move only in a
#: batch whose priced move penalty is at most this, i.e. where one lookup made local saves more bytes than
#: the sample sends (benchmarks/allocator_sweep.py: at dim 16, penalty 2, no penalty paid and keeping samples
#: home sent the fewest bytes; at dim 128, penalty 1, the priced allocator sent the fewest)
AUTO_MAX_PRICED_PENALTY = 1
PER_RANK_ALLOCATOR_REASON = (
    "pipeline.allocator=auto -> greedy on this rank's own batches, moving samples only in batches where one "
    "lookup made local saves more bytes than the sample sends (else they stay where loaded, no scores gathered)")
#: ``pipeline.scheduler_impl`` values: the lazy planners (by home, global, bounded staleness) in ``compiled``
#: code (``make setup`` builds it) or the ``python`` references; ``auto`` = compiled where built, else python
#: with a warning
SCHEDULER_IMPLS = ("auto", "compiled", "python")
#: ``pipeline.cache`` values executed for real (Belady exists at trace level:
#: ``torchrec_herald.testing.reference_plans.LazySyncPlanner``)
CACHE_POLICIES = ("lru",)
_SKIP_FIELDS = {"target": "skip_target", "tolerance": "skip_tolerance", "start": "skip_start", "gap": "skip_gap",
                "every": "skip_every", "t_max": "skip_t_max"}
_SKIP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SkipConfig) if f.name in _SKIP_FIELDS}


def _strategy_module(planning: str) -> bool:
    """A scheduling strategy module named ``planning`` exists (``pipeline/strategies/<planning>.py``)."""
    from torchrec_herald.pipeline.strategies import strategy_exists

    return planning not in ("global_batches", "gathered") and strategy_exists(planning)


@dataclass
class HeraldPipelineConfig:
    """The ``pipeline=herald`` group.

    Args:
        window: ``K >= 1``, global batches of look-ahead.
        allocator: ``greedy`` (location-aware), ``identity`` (samples stay where loaded) or ``auto``
            (default: greedy under global planning, identity by home; on per-rank batches, where a move
            sends the sample, the greedy allocator moves samples only in batches whose priced penalty is at
            most :data:`AUTO_MAX_PRICED_PENALTY`: one lookup made local must save more bytes than the
            sample sends, ``benchmarks/allocator_sweep.py``; identity where the model has a batch norm that
            normalises by its rank's batch). Moving samples keeps the global batch, so the mean loss over ranks
            and every weight are stock's for a loss that is a mean of per-sample terms; a loss that couples a
            rank's samples (in-batch negatives) needs ``identity``, and each rank's own loss is that of the
            samples it trained.
        sync: ``lazy`` (caches + plan) or ``eager`` (herald's per-step path, e.g. to measure the allocator alone).
        cache: cache eviction policy (``lru``).
        cache_fraction: cache capacity per rank per table as a fraction of the table's rows, in (0, 1].
        cache_bytes: ``None``, or the cache capacity per rank as a bytes budget (weights + optimizer
            state of the cached rows), shared among the tables in proportion to their rows; overrides
            ``cache_fraction``.
        move_penalty: local lookups a sample move must gain (``greedy_assign``'s ``move_penalty``), >= 0;
            ``None`` (default): priced per batch so that a move pays in time
            (:func:`~torchrec_herald.pipeline.input_allocator.priced_move_penalty`): 0 on whole global
            batches (every rank already holds every sample), else the least number of local lookups
            (``8 + 8D`` bytes each) whose bytes exceed one sample's on the exchange (dense, label,
            lengths, ids).
        global_batches: the data loader yields whole global batches (``W·B`` samples, from a seekable
            source): each rank schedules every batch alone (docs/design.md §3: no collective agrees on the
            allocation or the plan, no sample bytes move) and trains the samples assigned to it.
            ``None`` (default): when the loader is a :class:`~torchrec_herald.data.TrainStream` (it can
            read whole batches) and the planning is global (planning by home needs each rank's own batch).
        run_ahead: a background thread schedules the next batch entering the window (read, keys,
            allocation, reads) and plans the next step while the current step trains. Where the batches
            are per rank (a loader of this rank's own batches, or ``planning=by_home``) the scheduling's
            exchanges then run on a gloo process group of their own. ``None`` (default): on.
        scheduling: ``on``, ``off`` (hot replication alone) or ``auto`` (default: measure both, keep the
            faster, with whole global batches or planning by home; ``on`` where the batches are per rank and
            planned globally, or with ``staleness``, which relaxes the plan).
        probe_steps: ``auto``: steps timed in each mode (after ``probe_steps // 2`` unmeasured ones).
        planning: ``global`` (every rank plans every row), ``by_home`` (each rank plans its own rows from
            the keys the readers send it; needs ``allocator=identity``, per-rank batches, the exact plan
            and no skipping) or ``auto`` (default: :meth:`resolve_planning`).
        scheduler_impl: the lazy plan (by home or global, exact or bounded staleness) in ``compiled`` code,
            the ``python`` references, or ``auto`` (default: compiled where ``make setup`` built it, else
            python with a warning).
        staleness: ``None``: the exact plan; an integer ``s >= 0``: HET's bounded staleness (``sync=lazy``).
        skip: ``None``, ``input`` or ``row`` (Slipstream's stale-update skipping; a
            :class:`~torchrec_herald.pipeline.stale_skip.SkipConfig` is accepted too), tuned by the
            ``skip_*`` options (:class:`SkipConfig`'s fields). Works with either scheduling mode, on
            whole global batches and ahead like the exact plan.
        reference: approximate runs of the trainer first train the exact mode on the same batches and
            record both.
    """

    name: str = "herald"
    window: int = 5
    allocator: str = "auto"
    sync: str = "lazy"
    cache: str = "lru"
    cache_fraction: float = 0.05
    cache_bytes: Optional[int] = None
    move_penalty: Optional[int] = None
    global_batches: Optional[bool] = None
    run_ahead: Optional[bool] = None
    scheduling: str = "auto"
    probe_steps: int = 10
    planning: str = "auto"
    scheduler_impl: str = "auto"
    staleness: Optional[int] = None
    skip: Optional[str] = None
    skip_target: float = _SKIP_DEFAULTS["target"]
    skip_tolerance: float = _SKIP_DEFAULTS["tolerance"]
    skip_start: int = _SKIP_DEFAULTS["start"]
    skip_gap: int = _SKIP_DEFAULTS["gap"]
    skip_every: int = _SKIP_DEFAULTS["every"]
    skip_t_max: float = _SKIP_DEFAULTS["t_max"]
    reference: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.skip, SkipConfig):  # the Python API's form: spread into the skip_* options
            given = self.skip
            self.skip = given.granularity
            for attr, key in _SKIP_FIELDS.items():
                setattr(self, key, getattr(given, attr))
        if self.name != "herald":
            raise ValueError(f"HeraldPipelineConfig is the pipeline=herald group, got pipeline.name={self.name!r}")
        for key in ("window", "probe_steps"):
            check_int(f"pipeline.{key}", getattr(self, key))
        for key in ("cache_bytes", "move_penalty"):
            check_int(f"pipeline.{key}", getattr(self, key), optional=True)
        for key in ("global_batches", "run_ahead"):
            check_bool(f"pipeline.{key}", getattr(self, key), optional=True)
        check_bool("pipeline.reference", self.reference)
        check_real("pipeline.cache_fraction", self.cache_fraction)
        if int(self.window) < 1:
            raise ValueError(f"pipeline.window must be >= 1, got {self.window}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"unknown pipeline.allocator {self.allocator!r}; known: {list(ALLOCATORS)}")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"unknown pipeline.sync {self.sync!r}; known: {list(SYNC_MODES)}")
        if self.cache not in CACHE_POLICIES:
            raise ValueError(f"unknown pipeline.cache {self.cache!r}; executed policies: {list(CACHE_POLICIES)} "
                             f"(belady is trace-level only: torchrec_herald.testing.reference_plans.LazySyncPlanner)")
        if not 0.0 < float(self.cache_fraction) <= 1.0:
            raise ValueError(f"pipeline.cache_fraction={float(self.cache_fraction):g}: a cache must hold at least one row and "
                             f"at most all rows of a table; use a fraction in (0, 1]")
        if self.cache_bytes is not None and (isinstance(self.cache_bytes, bool) or int(self.cache_bytes) < 1):
            raise ValueError(f"pipeline.cache_bytes must be null or a positive number of bytes, got {self.cache_bytes}")
        if self.move_penalty is not None and (isinstance(self.move_penalty, bool) or int(self.move_penalty) < 0):
            raise ValueError(f"pipeline.move_penalty must be null (priced per batch) or an integer >= 0, "
                             f"got {self.move_penalty}")
        s = self.staleness
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or int(s) != s or int(s) < 0:
                raise ValueError(f"pipeline.staleness must be null (exact) or an integer >= 0, got {s}")
            if self.sync != "lazy":
                raise ValueError("pipeline.staleness needs pipeline.sync=lazy (it relaxes the caches' plan)")
            if self.scheduling == "off":
                raise ValueError("pipeline.staleness bounds the staleness of Herald scheduling's caches: it needs "
                                 "pipeline.scheduling=on or auto, got pipeline.scheduling=off")
        self.skip_config  # validates the skip_* options  # noqa: B018
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"unknown pipeline.scheduling {self.scheduling!r}; known: {list(SCHEDULING)}")
        if self.planning not in PLANNING and not _strategy_module(self.planning):
            raise ValueError(f"unknown pipeline.planning {self.planning!r}; known: {list(PLANNING)}")
        if self.scheduler_impl not in SCHEDULER_IMPLS:
            raise ValueError(f"unknown pipeline.scheduler_impl {self.scheduler_impl!r}; known: {list(SCHEDULER_IMPLS)}")
        if self.planning == "by_home":
            clash = [f"{k}={v}" for k, v, ok in (
                ("allocator", self.allocator, self.allocator in ("identity", "auto")),
                ("global_batches", self.global_batches, not self.global_batches),
                ("sync", self.sync, self.sync == "lazy"), ("staleness", self.staleness, self.staleness is None),
                ("skip", self.skip, self.skip is None), ("scheduling", self.scheduling, self.scheduling != "off"))
                if not ok]
            if clash:
                raise ValueError(f"pipeline.planning=by_home keeps no global view of the caches: it needs "
                                 f"allocator=identity (or auto), global_batches=false, sync=lazy, staleness=null, "
                                 f"skip=null and scheduling on or auto; got pipeline.{', pipeline.'.join(clash)}")
        if int(self.probe_steps) < 2:
            raise ValueError(f"pipeline.probe_steps must be >= 2, got {self.probe_steps}")
        self.probe_steps, self.window = int(self.probe_steps), int(self.window)
        self.cache_fraction = float(self.cache_fraction)
        self.move_penalty = None if self.move_penalty is None else int(self.move_penalty)
        self.staleness = None if s is None else int(s)

    @property
    def skip_config(self) -> Optional[SkipConfig]:
        """The ``skip*`` options as a :class:`SkipConfig` (None when skipping is off)."""
        if self.skip is None:
            return None
        return SkipConfig(granularity=self.skip, **{attr: getattr(self, key) for attr, key in _SKIP_FIELDS.items()})

    @property
    def approximate(self) -> bool:
        """An opt-in approximate mode (bounded staleness or stale-update skipping) is on."""
        return self.staleness is not None or self.skip is not None

    def planning_for(self, world_size: int) -> Tuple[str, str]:
        """``(planning, reason)`` for ``planning=auto`` on ``world_size`` ranks (the setting itself otherwise):
        global planning where a setting needs every rank's view (the greedy input allocator, an
        approximate mode, eager sync, scheduling off, whole global batches asked for) or up to
        :data:`GLOBAL_PLANNING_MAX_WORLD` ranks, where it measured faster; planning by home beyond. By
        home the input allocator is off: at W >= 8 it bought 5.75 vs 5.55 MiB of saving per rank-step for
        6.7 s of CPU per rank-step (benchmarks/RESULTS.md), and a rank planning its own rows has no view
        of where the other ranks' samples read."""
        if self.planning != "auto":
            return self.planning, f"pipeline.planning={self.planning} (set)"
        need_global = [f"pipeline.{k}={v}" for k, v, clash in (
            ("allocator", self.allocator, self.allocator == "greedy"), ("staleness", self.staleness, self.staleness is not None),
            ("skip", self.skip, self.skip is not None), ("sync", self.sync, self.sync != "lazy"),
            ("scheduling", self.scheduling, self.scheduling == "off"),
            ("global_batches", self.global_batches, self.global_batches is True)) if clash]
        if need_global:
            why = f"pipeline.planning=auto -> global: {', '.join(need_global)} needs every rank's view"
            if world_size > GLOBAL_PLANNING_MAX_WORLD:  # (where auto would have planned by home)
                why += (f"; at W={world_size} each rank then plans every rank's rows, a CPU cost a step that grows "
                        f"with W·B (0.33 s a rank-step at W=8, off the critical path only while it is shorter than "
                        f"the step); by home it grows with the rank's own reads")
            return "global", why
        if world_size <= GLOBAL_PLANNING_MAX_WORLD:
            return "global", (f"pipeline.planning=auto -> global at W={world_size} <= {GLOBAL_PLANNING_MAX_WORLD}: "
                              f"planning every row with the input allocator measured faster there")
        return "by_home", (f"pipeline.planning=auto -> by_home at W={world_size}: each rank plans the rows it is home "
                           f"to, ahead of the step; the input allocator is off (identity): at W >= 8 it buys "
                           f"little saving for a cost that grows with W·B")

    def resolve_planning(self, world_size: int) -> Tuple["HeraldPipelineConfig", str]:
        """The options with ``planning`` and ``allocator`` decided for ``world_size`` ranks (a copy), and
        the reason (:meth:`planning_for`)."""
        planning, why = self.planning_for(world_size)
        allocator = self.allocator if self.allocator != "auto" else ("identity" if planning == "by_home" else "greedy")
        return dataclasses.replace(self, planning=planning, allocator=allocator), why

    def scheduler_impl_choice(self) -> Tuple[str, Optional[str]]:
        """``(impl, why)`` of the lazy planner: ``compiled`` where ``make setup`` built it; with
        ``scheduler_impl=compiled`` and no usable build a ValueError naming the key; with ``auto`` the
        ``python`` reference and one line saying why."""
        if self.scheduler_impl == "python":
            return "python", None
        from torchrec_herald.native import unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            return "compiled", None
        if self.scheduler_impl == "compiled":
            raise ValueError(f"pipeline.scheduler_impl=compiled: {reason}")
        return "python", f"pipeline.scheduler_impl=auto -> python (the compiled scheduler is several times faster): {reason}"

    def resolve(self, whole_batches: bool, world_size: int) -> Tuple["HeraldPipelineConfig", List[str]]:
        """The options with ``planning`` and ``allocator`` decided for ``world_size`` ranks, then
        ``global_batches``, ``run_ahead`` and ``scheduling`` for a loader that can (``whole_batches``: a
        TrainStream over a seekable source) or cannot give whole global batches, and one line per
        decision that changed a setting. Explicit settings are kept (an explicit ``global_batches=True``
        means the loader yields whole global batches)."""
        c, planned = self.resolve_planning(world_size)
        why: List[str] = [] if planned.endswith("(set)") else [planned]
        gb = c.global_batches
        if gb is None:
            gb = whole_batches and c.planning == "global"
        # every strategy runs ahead: whole global batches alone, per-rank batches (gathered) and planning by
        # home with their scheduling collectives on a group of their own
        ra = True if c.run_ahead is None else c.run_ahead
        scheduling = c.scheduling
        # the probe needs every rank to agree on each batch's samples: whole global batches, or planning by
        # home (samples stay where loaded)
        if scheduling == "auto" and not ((gb or c.planning == "by_home") and c.staleness is None):
            scheduling = "on"
            why.append("pipeline.scheduling=auto -> on: " + (
                "HET's bounded staleness relaxes the plan's caches, which need scheduling on"
                if c.staleness is not None else
                "the probe needs whole global batches on every rank, or planning by home"))
        probe_on = probe_mode_steps(c.probe_steps)
        if scheduling == "auto" and c.window > probe_on:
            # the probe's off phase trains the window's batches within its own steps: a larger window would
            # leave some of them untrained
            raise ValueError(f"pipeline.window={c.window} is larger than the {probe_on} steps scheduling=auto "
                             f"probes with scheduling on (pipeline.probe_steps={c.probe_steps}: "
                             f"probe_steps // 2 + probe_steps); raise pipeline.probe_steps or lower the window")
        _, fallback = c.scheduler_impl_choice()  # (every sync mode builds a planner: eager's scores the allocator)
        if fallback is not None:
            why.append(fallback)
        return dataclasses.replace(c, global_batches=gb, run_ahead=ra, scheduling=scheduling), why

    def not_applied(self) -> List[str]:
        """One line for each option set away from its default where nothing reads it (a ``skip_*`` without
        ``skip``, ``move_penalty`` with the identity allocator, ``reference=false`` without an approximate mode):
        the trainer logs them as warnings before it builds anything."""
        lines = []
        if self.skip is None:
            lines += [f"pipeline.{key}={getattr(self, key)} is not applied: it tunes pipeline.skip, which is null"
                      for attr, key in _SKIP_FIELDS.items() if getattr(self, key) != _SKIP_DEFAULTS[attr]]
        if self.move_penalty is not None and self.allocator == "identity":
            lines.append(f"pipeline.move_penalty={self.move_penalty} is not applied: pipeline.allocator=identity "
                         f"moves no sample")
        if not self.reference and not self.approximate:
            lines.append("pipeline.reference=false is not applied: it skips the exact reference run of an "
                         "approximate mode (pipeline.staleness or pipeline.skip), and none is set")
        if self.scheduling == "off":  # (hot replication alone under TorchRec's pipeline: no scheduler runs)
            default = HeraldPipelineConfig.__dataclass_fields__
            lines += [f"pipeline.{key}={getattr(self, key)} is not applied: it tunes Herald scheduling, and "
                      f"pipeline.scheduling=off" for key in ("allocator", "sync", "cache", "cache_fraction", "cache_bytes",
                                                             "move_penalty", "planning", "scheduler_impl")
                      if getattr(self, key) != default[key].default and not (key == "move_penalty" and
                                                                             self.allocator == "identity")]
        if self.scheduling == "on" and self.probe_steps != HeraldPipelineConfig.__dataclass_fields__["probe_steps"].default:
            lines.append(f"pipeline.probe_steps={self.probe_steps} is not applied: it sizes scheduling=auto's probe, "
                         f"and pipeline.scheduling=on")
        return lines

    def check_run_length(self, total_steps: Optional[int]) -> None:
        """With ``total_steps`` (the run's steps, if known) the first skip measuring window must end inside
        the run; raises ValueError naming the keys."""
        skip = self.skip_config
        if skip is not None:
            skip.check_run_length(total_steps)

    @classmethod
    def from_hydra(cls, p: Any, total_steps: Optional[int] = None) -> "HeraldPipelineConfig":
        """From the ``pipeline`` node of the Hydra config (a structured config of this class); with
        ``total_steps`` the first skip measuring window must end inside the run."""
        from omegaconf import OmegaConf

        config = OmegaConf.to_object(p) if OmegaConf.is_config(p) else cls(**dict(p))
        assert isinstance(config, cls), type(config)
        config.check_run_length(total_steps)
        return config
