"""torchrec_herald: a TorchRec plugin that ships fewer embeddings per step and trains the same model.

Adopting it in a TorchRec script takes three edits (README, "Adopt it in your TorchRec code")::

    from torchrec_herald import HeraldEmbeddingBagCollectionSharder, HeraldPlanner, HeraldTrainPipeline

    sharder = HeraldEmbeddingBagCollectionSharder()
    plan = HeraldPlanner.from_batches(itertools.islice(dataset, 20)).collective_plan(model, [sharder])
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    pipeline = HeraldTrainPipeline(model, optimizer, device)

The names are imported on first use, so ``python -m torchrec_herald.train`` checks its arguments
before loading TorchRec.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

#: public name -> the module that defines it
_EXPORTS: Dict[str, str] = {
    "AccessStats": "torchrec_herald.planner",
    "HeraldPlanner": "torchrec_herald.planner",
    "HeraldEmbeddingBagCollectionSharder": "torchrec_herald.sharding",
    "HeraldTrainPipeline": "torchrec_herald.pipeline",
    "HeraldPipelineConfig": "torchrec_herald.pipeline",
    "LinkModel": "torchrec_herald.planner",
    "measured_link": "torchrec_herald.planner",
    "TrafficMeter": "torchrec_herald.traffic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'torchrec_herald' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
