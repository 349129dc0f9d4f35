"""Herald's variable-size collectives and the byte sizes of what travels on its wire, in one place.

Every herald exchange sends a different number of rows to each rank (P²RES's cold sub-bags, Herald's
plan transfers and sample moves), which TorchRec's pooled all-to-alls, built for a fixed number of rows
per sample, do not cover; these thin wrappers over ``torch.distributed`` are tagged for TrafficMeter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchrec_herald.traffic import traffic_tag

__all__ = [
    "FLOAT_BYTES", "INDEX_BYTES", "OPTIMIZER_STATE_BYTES", "SCORE_BYTES", "STOCK_ID_BYTES", "STOCK_LENGTH_BYTES",
    "LocalWork", "RowsInFlight", "all_gather_varlen", "all_reduce_async", "all_to_all_rows", "all_to_all_rows_async",
    "await_variable_all_to_all", "is_one_rank", "ring_allreduce_bytes", "row_with_state_bytes", "start_variable_all_to_all", "variable_all_to_all",
]

#: bytes of one embedding element (fp32 weights, pooled vectors and gradients)
FLOAT_BYTES = 4
#: bytes of an int32 id / sub-bag length / hot-row index on herald's wire
INDEX_BYTES = 4
#: bytes of one allocator score on the wire (int16)
SCORE_BYTES = 2
#: bytes of an id on stock TorchRec's input all-to-all (int64)
STOCK_ID_BYTES = 8
#: bytes of a stock length (int32)
STOCK_LENGTH_BYTES = 4
#: optimizer state per replicated or transferred row (row-wise Adagrad: one float)
OPTIMIZER_STATE_BYTES = 4


def row_with_state_bytes(embedding_dim: int) -> int:
    """Bytes of one stored row with its optimizer state: ``4D`` weights and row-wise Adagrad's one float (a hot
    replica, a cached row)."""
    return int(embedding_dim) * FLOAT_BYTES + OPTIMIZER_STATE_BYTES


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2·(W−1)/W·nbytes`` (what TrafficMeter counts
    at the call)."""
    return 2.0 * (world_size - 1) / world_size * nbytes


class LocalWork:
    """The work of a collective over one rank: nothing travels, so it is complete when made. Herald's
    collectives skip the process group there, as TorchRec's ``KJTAllToAll`` returns its input when its
    group has one worker: each skipped call is a launch and its bookkeeping on a GPU's host."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def is_one_rank(pg: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``pg`` (None: the default group) has a single rank: its collectives move nothing."""
    return dist.get_world_size(pg) == 1


def all_reduce_async(x: torch.Tensor, pg: Optional[dist.ProcessGroup], label: str, dim: Optional[int] = None) -> Any:
    """Start the sum of ``x`` over ``pg``'s ranks, in place: its work (:class:`LocalWork` at one rank, where
    the sum is ``x`` itself and no collective is issued)."""
    if is_one_rank(pg):
        return LocalWork()
    with traffic_tag(label, dim):
        return dist.all_reduce(x, group=pg, async_op=True)


def all_to_all_rows(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], pg: Optional[dist.ProcessGroup],
                    label: str, dim: Optional[int] = None) -> torch.Tensor:
    """``send[j]`` leading rows of ``x`` go to rank j, ``recv[i]`` rows come from rank i (in rank order);
    no autograd. ``label`` / ``dim``: the TrafficMeter tag and the floats per embedding vector. At one rank
    the rows are ``x``'s own, copied (a fresh buffer, as from a collective), and no collective is issued."""
    if is_one_rank(pg):
        return x.clone()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with traffic_tag(label, dim):
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=pg)
    return out


def all_to_all_rows_async(x: torch.Tensor, send: Sequence[int], recv: Sequence[int],
                          pg: Optional[dist.ProcessGroup], label: str, dim: Optional[int] = None
                          ) -> Tuple[torch.Tensor, Any]:
    """:func:`all_to_all_rows` started now, finished by ``work.wait()``: returns ``(out, work)``; ``out``
    holds the received rows once waited for. At one rank ``out`` is ``x`` itself (no copy: the callers
    send buffers of their own) and ``work`` a :class:`LocalWork`."""
    if is_one_rank(pg):
        return x, LocalWork()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with traffic_tag(label, dim):
        work = dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=pg, async_op=True)
    return out, work


@dataclass
class RowsInFlight:
    """A variable-size all-to-all started by :func:`start_variable_all_to_all`: the receive buffer, the
    work, and what its backward needs (the splits, the group, the TrafficMeter labels)."""

    out: torch.Tensor
    work: Any
    send: List[int]
    recv: List[int]
    pg: Optional[dist.ProcessGroup]
    labels: Tuple[str, str]
    dim: int


def start_variable_all_to_all(x: torch.Tensor, send: List[int], recv: List[int], pg: Optional[dist.ProcessGroup],
                              labels: Tuple[str, str] = ("herald_a2a", "herald_a2a_grad"), dim: int = 0
                              ) -> RowsInFlight:
    """Start the variable-size all-to-all of the rows of ``x`` (``send[j]`` rows go to rank j); the caller
    does other work, then :func:`await_variable_all_to_all` joins it to autograd. ``x`` must not change
    in between."""
    out, work = all_to_all_rows_async(x.detach(), send, recv, pg, labels[0], dim)
    return RowsInFlight(out, work, list(send), list(recv), pg, labels, dim)


class _AwaitedAllToAll(torch.autograd.Function):
    """Waits for a started all-to-all of ``x``'s rows; its backward sends the gradients the other way
    (synchronously: the cold rows' backward needs them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: RowsInFlight) -> torch.Tensor:  # type: ignore[override]
        # only the route back: keeping ``flight`` (whose ``out`` is this node's own output) on ctx would
        # make a cycle through the autograd graph that Python's collector cannot see, and leak both
        # buffers of every step
        ctx.route = (list(flight.recv), list(flight.send), flight.pg, flight.labels[1], flight.dim)
        flight.work.wait()
        return flight.out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:  # type: ignore[override]
        recv, send, pg, label, dim = ctx.route
        return all_to_all_rows(grad, recv, send, pg, label, dim), None


def await_variable_all_to_all(x: torch.Tensor, flight: RowsInFlight) -> torch.Tensor:
    """The rows received by ``flight`` (started from ``x``), differentiable with respect to ``x``. At one
    rank they are ``x`` itself: no autograd node, no collective either way."""
    if isinstance(flight.work, LocalWork):
        return x
    return _AwaitedAllToAll.apply(x, flight)


def variable_all_to_all(x: torch.Tensor, send: List[int], recv: List[int], pg: dist.ProcessGroup,
                        labels: Tuple[str, str] = ("herald_a2a", "herald_a2a_grad"), dim: int = 0) -> torch.Tensor:
    """Autograd-aware variable-size all-to-all of the rows of ``x`` (``send[j]`` rows go to rank j)."""
    return await_variable_all_to_all(x, start_variable_all_to_all(x, send, recv, pg, labels, dim))


def all_gather_varlen(mine: torch.Tensor, pg: Optional[dist.ProcessGroup], label: str) -> List[torch.Tensor]:
    """Every rank's 1-D ``mine`` (any length): an all-gather of the lengths, then one all-to-all sending
    ``mine`` to every rank (``all_gather`` needs equal sizes). At one rank: ``[mine]``, no collective."""
    W = dist.get_world_size(pg)
    if W == 1:
        return [mine]
    counts = torch.empty(W, dtype=torch.int64)
    with traffic_tag(label):
        dist.all_gather_into_tensor(counts, torch.tensor([mine.numel()], dtype=torch.int64), group=pg)
    sizes = counts.tolist()
    out = all_to_all_rows(mine.repeat(W), [mine.numel()] * W, sizes, pg, label)
    return list(out.split(sizes))
