"""Stock TorchRec planning: the default ``EmbeddingShardingPlanner`` plan, or one sharding type forced
on every table (the fair TABLE_WISE reference of docs/design.md §2)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import StorageReservation
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_herald.planner.topology import default_storage_reservation, make_topology
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

logger = logging.getLogger(__name__)

#: planner.mode values and the sharding type they force (None: TorchRec decides).
STOCK_MODES: Dict[str, Optional[str]] = {
    "default": None,
    "table_wise": ShardingType.TABLE_WISE.value,
    "row_wise": ShardingType.ROW_WISE.value,
}


def stock_constraints(tables: List[EmbeddingBagConfig], mode: str,
                      given: Optional[Dict[str, ParameterConstraints]] = None
                      ) -> Optional[Dict[str, ParameterConstraints]]:
    """ParameterConstraints forcing ``mode``'s sharding type on every table (None for ``default``). ``given``, a
    user's constraints, stay as they are: a table whose sharding types they name keeps them, and the mode's
    type is added to the others' constraints."""
    if mode not in STOCK_MODES:
        raise ValueError(f"unknown planner.mode {mode!r}; expected one of {sorted(STOCK_MODES)}")
    if given:  # herald's own type, where a user allowed it, is ROW_WISE's layout for TorchRec's planner
        given = {n: c if HERALD_HOT_ROW_WISE not in (c.sharding_types or []) else dataclasses.replace(
            c, sharding_types=list(dict.fromkeys(ShardingType.ROW_WISE.value if t == HERALD_HOT_ROW_WISE else t
                                                 for t in c.sharding_types)))
                 for n, c in given.items()}
    forced = STOCK_MODES[mode]
    if forced is None:
        return dict(given) if given else None
    given = given or {}
    out = {t.name: ParameterConstraints(sharding_types=[forced]) for t in tables}
    for name, c in given.items():
        out[name] = c if c.sharding_types else dataclasses.replace(c, sharding_types=[forced])
    return out


def stock_plan(module: nn.Module, tables: List[EmbeddingBagConfig], sharders: List[ModuleSharder],
               mode: str, world_size: int, local_batch_size: int, device: torch.device,
               pg: Optional[dist.ProcessGroup] = None, *, topology: Optional[Topology] = None,
               storage_reservation: Optional[StorageReservation] = None,
               constraints: Optional[Dict[str, ParameterConstraints]] = None) -> ShardingPlan:
    """Plan ``module`` with TorchRec's own planner (collectively when a process group is given). ``topology``,
    ``storage_reservation`` and ``constraints``: a user's, as given to :class:`HeraldPlanner` (the defaults
    otherwise), so that the stock candidates it weighs are the plans stock TorchRec would make for them."""
    planner = EmbeddingShardingPlanner(
        topology=topology or make_topology(world_size, device.type),
        batch_size=local_batch_size,
        storage_reservation=storage_reservation or default_storage_reservation(),
        constraints=stock_constraints(tables, mode, constraints),
    )
    with _DataParallelSpecNotice() as notice:
        plan = planner.collective_plan(module, sharders, pg) if pg is not None else planner.plan(module, sharders)
    if notice.tables:
        logger.info("TorchRec's %s plan: %d DATA_PARALLEL table(s) (%s) carry no sharding spec, as TorchRec "
                    "plans them (its planner warns once per table; folded here)", mode, len(notice.tables),
                    ", ".join(notice.tables))
    return plan


class _DataParallelSpecNotice(logging.Filter):
    """Folds the warning TorchRec's planner logs (root logger) for every table without a sharding spec,
    which every DATA_PARALLEL table is by design, into one info line naming them; any other record
    passes. By hand: TorchRec has no switch for it."""

    PREFIX = "Sharding spec not found for "

    def __init__(self) -> None:
        super().__init__()
        self.tables: List[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.levelno == logging.WARNING and msg.startswith(self.PREFIX):
            self.tables.append(msg[len(self.PREFIX):].rsplit(".", 1)[-1])
            return False
        return True

    def __enter__(self) -> "_DataParallelSpecNotice":
        logging.getLogger().addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeFilter(self)


def describe_plan(plan: ShardingPlan) -> Dict[str, str]:
    """table name -> sharding type, for logs and metrics."""
    out: Dict[str, str] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            out[name] = ps.sharding_type
    return out
