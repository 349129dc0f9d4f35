"""The plan executor's forward and backward size nothing by the data (``sharding/plan_exec.py``): the
working set and the reduce's route are found in ``begin()``, before the forward; a batch whose rows differ
from the plan's still fails with one clear error, raised after backward and before any row is updated."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchrec_herald.sharding.plan_exec import PlanExecutor

SYNC_OPS = {"_local_scalar_dense", "nonzero", "bincount", "_unique2", "masked_select", "repeat_interleave"}


class _Store(SimpleNamespace):
    def read(self, keys: torch.Tensor) -> tuple:
        self.reads.append(keys.clone())
        return keys.to(torch.float32)[:, None].repeat(1, self.dim), torch.zeros(keys.numel())


def _executor(compiled: bool = False) -> tuple:
    """An executor over a fake store; ``compiled``: with the compiled row access's module (its forward
    lookup, ``plan_positions``), else the torch ops."""
    from torchrec_herald import native

    store = _Store(rank=0, dim=2, adagrad=False, device=torch.device("cpu"), reads=[],
                   layout=SimpleNamespace(world_size=1), native=native.load() if compiled else None)
    empty = torch.zeros(0, 3, dtype=torch.int64)
    plan = SimpleNamespace(reads=[torch.tensor([2, 5, 7])], reduce=empty, partial=False, additive=False,
                           push_before_read=empty, push_before_read_add=torch.zeros(0, dtype=torch.bool), pull=empty,
                           update_keys=torch.tensor([2, 5, 7]), reducer=torch.zeros(3, dtype=torch.int64))
    return PlanExecutor(store, None), store, plan


class _Syncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in SYNC_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True])
def test_begin_loads_the_working_set_and_the_forward_only_indexes_it(compiled: bool) -> None:
    ex, store, plan = _executor(compiled)
    ex.begin(plan)
    assert [k.tolist() for k in store.reads] == [[2, 5, 7]]  # read once, before the forward
    with _Syncs() as mode:
        pos = ex.working_set(torch.tensor([7, 2, 5, 5]))
    assert pos.tolist() == [2, 0, 1, 1] and mode.seen == []
    assert len(store.reads) == 1 and ex.ws is not None and ex.ws[:, 0].tolist() == [2.0, 5.0, 7.0]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("keys", [[5, 2, 9], [2, 5], [8]])
def test_a_batch_that_differs_from_its_plan_fails_after_backward_before_any_update(keys: list, compiled: bool) -> None:
    ex, store, plan = _executor(compiled)
    ex.begin(plan)
    with _Syncs() as mode:
        pos = ex.working_set(torch.tensor(keys))  # no error and no sync inside the forward ...
    assert mode.seen == []
    assert 0 <= int(pos.min()) and int(pos.max()) < 3  # (and every lookup inside the working set's rows)
    with pytest.raises(RuntimeError, match=r"rank 0: the batch's rows differ from the ones the plan was made for"):
        ex.finish()  # ... the check runs here, before after_backward touches a row
    assert not ex.active
