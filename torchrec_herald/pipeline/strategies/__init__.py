"""How a herald pipeline schedules a batch: one strategy object per planning mode, behind one interface,
chosen by a registry (as ``input_allocator.build_allocator`` chooses the allocator). Each strategy is a
module of this package, found by its name.

A :class:`SchedulingStrategy` says what kind of batch each rank reads (the whole global batch, or its
own share), which planner plans the steps, and which bodies of the allocate and reads stages
(``pipeline/stages/``) run. Registered strategies:

* ``global_batches``: every rank reads the whole global batch from the seekable source and schedules it
  alone: no collective agrees on the allocation or the plan, no sample moves; it can run ahead.
* ``gathered``: each rank reads its own batch; scores and read keys are all-gathered, samples move in
  all-to-alls; every rank plans every row.
* ``by_home``: each rank reads its own batch and plans only the rows it is home to, from the read keys
  sent to it (``HomeSplitLazyPlanner``).

A new planning mode is one module here, ``<name>.py``, holding a :class:`SchedulingStrategy` subclass
decorated with :func:`register_strategy`; ``pipeline.planning=<name>`` picks it (``global`` is the
planning mode of both ``global_batches`` and ``gathered``, by the kind of batch the loader gives).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Type

import torch

from torchrec_herald.comm import all_to_all_rows
from torchrec_herald.pipeline.context import CommTimer, HeraldBatchContext, SchedulingEnv
from torchrec_herald.plans import CommPlanner, SyncCounters

logger = logging.getLogger(__name__)

__all__ = ["STRATEGIES", "SchedulingStrategy", "build_planner", "build_strategy", "register_strategy", "strategy_exists",
           "strategy_name"]

#: strategy name -> class (:func:`register_strategy`)
STRATEGIES: Dict[str, Type["SchedulingStrategy"]] = {}


def register_strategy(cls: Type["SchedulingStrategy"]) -> Type["SchedulingStrategy"]:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    if cls.name in STRATEGIES:
        raise ValueError(f"a scheduling strategy named {cls.name!r} is registered already")
    STRATEGIES[cls.name] = cls
    return cls


class SchedulingStrategy(abc.ABC):
    """One planning mode of the herald pipeline.

    Attributes:
        name: the registry key.
        whole_batches: every rank reads the whole global batch (the loader must yield them).
        can_run_ahead: a worker thread may run its scheduling ahead of the step (its collectives, if any,
            on a process group of their own: ``scheduling_collectives``).
    """

    name: ClassVar[str]
    whole_batches: ClassVar[bool] = False
    can_run_ahead: ClassVar[bool] = False
    #: its scheduling has collectives: running ahead, it gets a process group of its own
    scheduling_collectives: ClassVar[bool] = True

    def __init__(self, env: SchedulingEnv, config: Any) -> None:  # config: the resolved HeraldPipelineConfig
        self.env, self.config = env, config

    @abc.abstractmethod
    def allocate(self, ctx: HeraldBatchContext) -> None:
        """Stage 2: which rank trains which sample of the batch (``pipeline/stages/allocate.py``)."""

    @abc.abstractmethod
    def collect_reads(self, ctx: HeraldBatchContext, reads_needed: bool, lazy: bool) -> None:
        """Stage 3: every rank's reads (``pipeline/stages/reads.py``); ``reads_needed``: the plan may be on
        now or later, ``lazy``: it is on now."""

    def plan_counters(self) -> SyncCounters:
        """The plan's counters over all ranks (every rank plans every row: its own counters)."""
        return self.env.stats.counters


def strategy_name(config: Any) -> str:
    """The strategy a resolved config asks for: ``pipeline.planning``, where ``global`` is
    ``global_batches`` or ``gathered`` by the kind of batch the loader gives."""
    if config.planning == "global":
        return "global_batches" if config.global_batches else "gathered"
    return config.planning


def strategy_exists(name: str) -> bool:
    """A module ``<name>.py`` of this package holds the strategy (it may not be imported yet)."""
    import importlib.util

    return name.isidentifier() and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None


def build_strategy(name: str, env: SchedulingEnv, config: Any) -> SchedulingStrategy:
    """The strategy registered as ``name``, its module imported on first use."""
    import importlib

    if name not in STRATEGIES and strategy_exists(name):
        importlib.import_module(f"{__name__}.{name}")
    if name not in STRATEGIES:
        raise ValueError(f"unknown scheduling strategy {name!r}; registered: {sorted(STRATEGIES)}")
    return STRATEGIES[name](env, config)


def exchange_words(env: SchedulingEnv) -> Callable[[Any], Any]:
    """Planning by home's exchange of :class:`~torchrec_herald.pipeline.home_split.Messages`: an all-to-all
    of the per-peer section counts, then one of the words, timed as scheduler comm."""
    from torchrec_herald.pipeline.home_split import Messages

    def exchange(sent: Messages) -> Messages:
        W, S = sent.counts.shape
        with CommTimer(env.stats, "herald_schedule_meta"):
            group = env.scheduling_group
            counts = all_to_all_rows(sent.counts, [1] * W, [1] * W, group, "herald_schedule_meta")
            data = all_to_all_rows(sent.data, sent.counts.sum(1).tolist(), counts.sum(1).tolist(), group,
                                   "herald_schedule_meta")
        return Messages(counts.view(W, S), data)

    return exchange


def build_planner(config: Any, env: SchedulingEnv, capacity_rows: Optional[Mapping[str, int]]) -> CommPlanner:
    """The communication planner of ``config``: by home (each rank its own rows, exchanging words through
    ``env``), bounded staleness, or the exact lazy plan; each compiled or the Python reference, by
    ``pipeline.scheduler_impl``."""
    from torchrec_herald.pipeline.home_split import HomeSplitLazyPlanner
    from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
    from torchrec_herald.pipeline.staleness import StalenessPlanner

    c, layout = config, env.layout
    impl, fallback = c.scheduler_impl_choice()
    if fallback is not None:
        logger.warning("%s", fallback)
    if c.planning == "by_home":
        if impl == "python":
            return HomeSplitLazyPlanner(layout, env.rank, exchange_words(env), c.cache_fraction, c.window, capacity_rows)
        from torchrec_herald.pipeline.home_split_native import CompiledHomeSplitPlanner

        return CompiledHomeSplitPlanner(layout, env.rank, exchange_words(env), c.cache_fraction, c.window,
                                        capacity_rows)
    if impl == "python":
        if c.staleness is None:
            return TensorLazySyncPlanner(layout, c.cache_fraction, c.window, capacity_rows)
        return StalenessPlanner(layout, c.staleness, c.cache_fraction, c.window, capacity_rows)
    from torchrec_herald.pipeline.lazy_sync_native import CompiledLazySyncPlanner, CompiledStalenessPlanner

    if c.staleness is None:
        return CompiledLazySyncPlanner(layout, c.cache_fraction, c.window, capacity_rows)
    return CompiledStalenessPlanner(layout, c.staleness, c.cache_fraction, c.window, capacity_rows)
