"""The plan executor's forward and backward size nothing by the data (``sharding/plan_exec.py``): the
working set and the reduce's route are found in ``begin()``, before the forward; a batch whose rows differ
from the plan's still fails with one clear error, raised after backward and before any row is updated."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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


class _Seen(TorchDispatchMode):
    """Records the ops among ``names`` dispatched inside it, in order."""

    def __init__(self, names: frozenset = frozenset(SYNC_OPS)) -> None:
        super().__init__()
        self.names, self.seen = names, []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in self.names:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True])
def test_begin_loads_the_working_set_and_the_forward_only_indexes_it(compiled: bool) -> None:
    ex, store, plan = _executor(compiled)
    ex.begin(plan)
    assert [k.tolist() for k in store.reads] == [[2, 5, 7]]  # read once, before the forward
    with _Seen() as mode:
        pos = ex.working_set(torch.tensor([7, 2, 5, 5]))
    assert pos.tolist() == [2, 0, 1, 1] and mode.seen == []
    assert len(store.reads) == 1 and ex.ws is not None and ex.ws[:, 0].tolist() == [2.0, 5.0, 7.0]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("keys", [[5, 2, 9], [2, 5], [8]])
def test_a_batch_that_differs_from_its_plan_fails_after_backward_before_any_update(keys: list, compiled: bool) -> None:
    ex, store, plan = _executor(compiled)
    ex.begin(plan)
    with _Seen() as mode:
        pos = ex.working_set(torch.tensor(keys))  # no error and no sync inside the forward ...
    assert mode.seen == []
    assert 0 <= int(pos.min()) and int(pos.max()) < 3  # (and every lookup inside the working set's rows)
    with pytest.raises(RuntimeError, match=r"rank 0: the batch's rows differ from the ones the plan was made for"):
        ex.finish()  # ... the check runs here, before after_backward touches a row
    assert not ex.active


class _ReducerStore(SimpleNamespace):
    """Rank 1 of 3's rows, recording what the executor hands it."""

    def apply_gradient(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        self.applied = (keys.clone(), grad.clone())

    def receive(self, keys: torch.Tensor, rows: torch.Tensor, add: torch.Tensor) -> None:
        self.received.append((keys.tolist(), rows[:, 0].tolist(), add.tolist()))

    def drop(self, keys: torch.Tensor) -> None:
        pass


def _rank_one_of_three() -> tuple:
    store = _ReducerStore(rank=1, dim=1, adagrad=False, device=torch.device("cpu"), native=None,
                          layout=SimpleNamespace(world_size=3), received=[])
    return PlanExecutor(store, None), store


def test_the_reduce_sums_each_rows_gradients_in_rank_order_in_one_op_whatever_the_ranks() -> None:
    """At rank 1 of 3, rows 10 and 20 have gradients from rank 0, from this rank's own backward and from
    rank 2, chosen so that float32 gives another sum in any other order: each row gets ((0 + g0) + g1) + g2,
    and one op adds them all (an op a source cost W of them, a kernel launch each on a GPU)."""
    ex, store = _rank_one_of_three()
    big = 1e8  # float32's step there is 8: 1e8 + 1 rounds to 1e8
    g0, g1, g2 = [big, 1.0], [1.0, big], [-big, -big]
    empty = torch.zeros(0, 3, dtype=torch.int64)
    # (key, src, dst) of the gradients sent to their reducer, rank 1; rank 1's own are not sent
    reduce = torch.tensor([[10, 0, 1], [20, 0, 1], [10, 2, 1], [20, 2, 1]])
    plan = SimpleNamespace(reduce=reduce, partial=False, additive=False, update_keys=torch.tensor([10, 20]),
                           reducer=torch.tensor([1, 1]), update_push=empty, miss_push=empty,
                           evictions=[torch.zeros(0, dtype=torch.int64)] * 3)
    received = torch.tensor([g0, g2]).reshape(4, 1)  # rank 0's two rows, then rank 2's
    started = ([torch.tensor([0, 1]), torch.zeros(0, dtype=torch.int64), torch.tensor([2, 3])], received,
               SimpleNamespace(wait=lambda: None))
    ws_keys, ws_grad = torch.tensor([10, 20]), torch.tensor(g1)[:, None]
    in_order = [((torch.zeros((), dtype=torch.float32) + a) + b) + c for a, b, c in zip(g0, g1, g2)]
    assert in_order[0] != (torch.tensor(g0[0]) + g2[0]) + g1[0]  # (the values tell the orders apart)
    assert in_order[1] != (torch.tensor(g1[1]) + g2[1]) + g0[1]
    with _Seen(frozenset({"index_add_", "index_add", "index_put_", "add_"})) as ops:
        ex.after_backward(plan, ws_keys, ws_grad, started)
    keys, grad = store.applied
    assert keys.tolist() == [10, 20] and grad[:, 0].tolist() == [float(t) for t in in_order]
    assert ops.seen == ["index_add_"]


@pytest.mark.parametrize("adds", [False, True])
def test_rows_received_from_several_ranks_are_stored_in_one_call_unless_updates_add(adds: bool) -> None:
    """Rows that replace (a pull, an exact push: one a row an exchange) are stored in one call whatever the
    number of sources; added updates are stored source after source, in rank order (one row may get
    several)."""
    ex, store = _rank_one_of_three()
    keys = torch.tensor([7, 8, 9])
    add = torch.tensor([False, adds, adds])
    recv_pos = [torch.tensor([1]), torch.zeros(0, dtype=torch.int64), torch.tensor([2, 0])]  # rank 0's, rank 2's
    out = torch.tensor([[80.0], [90.0], [70.0]])
    ex._store_received(keys, add, recv_pos, out)
    if adds:
        assert store.received == [([8], [80.0], [True]), ([9, 7], [90.0, 70.0], [True, False])]
    else:
        assert store.received == [([8, 9, 7], [80.0, 90.0, 70.0], [False, False, False])]
