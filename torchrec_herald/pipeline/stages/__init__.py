"""The stages a batch runs through on entering herald's window, one module each, in the order of their
registration numbers: ``keys`` (10: validate ids, global row keys), ``allocate`` (20: which rank trains
which sample), ``skip_inputs`` (30: stale-update skipping drops inputs), ``reads`` (40: every rank's
rows). Once per step, ``plan`` (``stages/plan.py``) plans the step's transfers from the window's reads.

Each batch stage is a function ``stage(host, ctx)`` over the batch's
:class:`~torchrec_herald.pipeline.context.HeraldBatchContext` (``ctx.batch`` holds the loader's batch
when the first stage runs) and the pipeline, seen through :class:`StageHost`. A new stage is one module
of this package whose function is decorated with :func:`register_stage`: the modules are found and
imported on first use.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from torchrec_herald.pipeline.context import HeraldBatchContext, SchedulingEnv

__all__ = ["BatchStage", "StageHost", "batch_stages", "register_stage"]


class StageHost(Protocol):
    """What a batch stage may ask of the pipeline."""

    env: SchedulingEnv
    strategy: Any  # the SchedulingStrategy: which allocate / reads bodies run
    skip_hook: Optional[Any]  # stale-update skipping (None when off)
    live_inputs: Optional[Any]  # input skipping on whole global batches: the stream that drops and refills
    reads_needed: bool  # every rank's reads are needed (the plan is on now, or may be later)
    lazy: bool  # the plan is on now


BatchStage = Callable[[StageHost, HeraldBatchContext], None]
_STAGES: Dict[str, Tuple[int, BatchStage]] = {}
_DISCOVERED = False


def register_stage(name: str, order: int) -> Callable[[BatchStage], BatchStage]:
    """Decorator: run ``fn`` on every batch entering the window, at position ``order`` (ascending)."""

    def register(fn: BatchStage) -> BatchStage:
        if name in _STAGES:
            raise ValueError(f"a batch stage named {name!r} is registered already")
        if any(o == order for o, _ in _STAGES.values()):
            raise ValueError(f"batch stage {name!r}: order {order} is taken")
        _STAGES[name] = (order, fn)
        return fn

    return register


def batch_stages() -> List[Tuple[str, BatchStage]]:
    """The registered batch stages, in order (the package's stage modules imported on the first call)."""
    global _DISCOVERED
    if not _DISCOVERED:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _DISCOVERED = True
    return [(name, fn) for name, (_, fn) in sorted(_STAGES.items(), key=lambda kv: kv[1][0])]
