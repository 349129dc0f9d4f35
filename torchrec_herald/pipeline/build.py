"""The one interface the trainer drives a train pipeline through, whichever it is, and the factory that
builds the configured one: TorchRec's ``TrainPipelineSparseDist`` / ``TrainPipelineBase``
(``pipeline=sparse_dist|base``) behind :class:`TorchRecPipeline`, or herald's
:class:`~torchrec_herald.pipeline.HeraldTrainPipeline` (``pipeline=herald``), which implements the
interface itself. So the trainer needs no ``isinstance`` and writes no pipeline's attributes."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, Optional, Protocol, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

from torchrec_herald.pipeline.options import HeraldPipelineConfig
from torchrec_herald.pipeline.train_pipeline import HeraldTrainPipeline

__all__ = ["PIPELINES", "TorchRecPipeline", "TrainingPipeline", "build_pipeline"]

logger = logging.getLogger(__name__)

#: ``pipeline.name`` of TorchRec's own pipelines -> class
PIPELINES = {"sparse_dist": TrainPipelineSparseDist, "base": TrainPipelineBase}


class TrainingPipeline(Protocol):
    """What the trainer asks of a train pipeline."""

    #: the pipeline plans herald's transfers (its EBC's per-table traffic counters do not see them)
    plan_mode: bool

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train one batch; ``StopIteration`` when the loader and the pipeline are empty."""

    def checkpoint_after_next_step(self) -> None:
        """A checkpoint follows the next step."""

    def checkpoint_schedule(self, due: Callable[[int], bool]) -> None:
        """The checkpoints to come: ``due(n)``, one is saved once ``n`` steps have trained (set once, before
        the first step)."""

    def prepare_checkpoint(self) -> bool:
        """Before a save (collective): bring the model to a savable state; True when the data iterator must
        restart at the saved position afterwards."""

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """What a checkpoint keeps of the pipeline (JSON-able), or None."""

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`."""

    def snapshot(self) -> Any:
        """A mark from which :meth:`report` and :meth:`scheduler_seconds` count (a resumed run's attempt)."""

    def report(self, since: Any = None, step_time_s: float = 0.0) -> Dict[str, Any]:
        """``metrics.json`` ``herald_pipeline`` since ``since`` (collective for some modes); ``{}`` if none."""

    def approximate_report(self, since: Any = None) -> Dict[str, Any]:
        """An approximate mode's own figures (skipped and stale shares) since ``since``; ``{}`` if exact."""

    def scheduler_seconds(self, since: Any = None) -> Tuple[float, float]:
        """Scheduling seconds since ``since``: (on the critical path, done ahead)."""

    def end_turn(self) -> None:
        """Another run trains next in the same ranks (``compare_with``'s turns): let the work this pipeline runs
        beside its steps (herald's run-ahead scheduler) finish, keeping what it made, and time no step across the
        other run's turn."""

    def detach(self) -> nn.Module:
        """Hand the model back in its plain sharded layout (flushing any caches)."""


class TorchRecPipeline:
    """A TorchRec pipeline behind :class:`TrainingPipeline`: no scheduling, nothing to checkpoint."""

    plan_mode = False

    def __init__(self, inner: Union[TrainPipelineSparseDist, TrainPipelineBase], model: nn.Module,
                 not_applied: Optional[str] = None) -> None:
        self.inner, self._model = inner, model
        self._not_applied = not_applied  # an approximate mode asked for and not run: why

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        return self.inner.progress(dataloader_iter)

    def checkpoint_after_next_step(self) -> None:
        return None

    def checkpoint_schedule(self, due: Callable[[int], bool]) -> None:
        return None

    def prepare_checkpoint(self) -> bool:
        return False

    def state_dict(self) -> Optional[Dict[str, Any]]:
        return None

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        return None

    def snapshot(self) -> Any:
        return None

    def report(self, since: Any = None, step_time_s: float = 0.0) -> Dict[str, Any]:
        return {}

    def approximate_report(self, since: Any = None) -> Dict[str, Any]:
        return {} if self._not_applied is None else {"applied": False, "reason": self._not_applied}

    def scheduler_seconds(self, since: Any = None) -> Tuple[float, float]:
        return 0.0, 0.0

    def end_turn(self) -> None:
        return None  # (TorchRec's pipelines run no thread of their own and time no step)

    def detach(self) -> nn.Module:
        """TorchRec's ``TrainPipelineSparseDist`` rewrote the model's forwards: restore them."""
        detach = getattr(self.inner, "detach", None)
        return detach() if callable(detach) else self._model


def build_pipeline(config: Any, model: nn.Module, optimizer: Any, device: torch.device,
                   herald_sharded: bool = True) -> TrainingPipeline:
    """The pipeline ``config`` (the ``pipeline`` group: a ``HeraldPipelineConfig`` or TorchRec's
    pipeline's name) asks for. ``herald_sharded``: the planner sharded the model with herald's sharder
    (False where the model of time chose a stock plan: herald's pipeline then has nothing to schedule,
    and TorchRec's ``TrainPipelineSparseDist`` trains)."""
    if isinstance(config, HeraldPipelineConfig):
        if not herald_sharded:
            logger.info("pipeline=herald: the model of time chose a stock plan (see the planner's line), training "
                        "with TorchRec's TrainPipelineSparseDist")
            not_applied = None
            if config.approximate:  # (an opt-in mode of herald's scheduling: a stock plan has none to relax)
                asked = ", ".join(f"pipeline.{k}={v}" for k, v in (("staleness", config.staleness),
                                                                   ("skip", config.skip)) if v is not None)
                not_applied = (f"{asked} not applied: the model of time chose a stock plan on this link (see the "
                               f"planner's line), which has no herald cache or hot row to relax; "
                               f"planner.link_mbit=null keeps herald's plan")
                logger.warning("pipeline=herald: %s", not_applied)
            return TorchRecPipeline(TrainPipelineSparseDist(model, optimizer, device), model, not_applied)
        return HeraldTrainPipeline(model, optimizer, device, config=config)
    name = getattr(config, "name", config)
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline.name {name!r}; expected one of {sorted(PIPELINES) + ['herald']}")
    return TorchRecPipeline(PIPELINES[name](model, optimizer, device), model)
