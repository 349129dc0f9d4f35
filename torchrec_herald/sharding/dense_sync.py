"""Forward-ordered dense gradient sums: a TorchRec ``DataParallelWrapper`` that replaces DDP's wait.

DDP waits for every dense gradient's all-reduce at the end of backward, yet the next forward needs a
layer's weights only when it reaches that layer. Here each group of layers starts its sum in backward as
soon as its gradients are complete, on a process group of its own, and the sum is waited for and applied
(the group's own optimizer step) just before that group's next forward. Exact: the same averaged
gradients and the same per-parameter updates as DDP + the dense optimizer, applied before any read of
the weights (forward, ``state_dict``, ``load_state_dict``, the optimizer's state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from torchrec_herald.traffic import traffic_tag

logger = logging.getLogger(__name__)

#: consecutive layers holding less than this are summed in one collective (fewer per-call latencies)
DEFAULT_GROUP_BYTES = 16 * 1024


@dataclass
class DenseGroup:
    """Parameters of consecutive layers (in registration order, DLRM's forward order) summed together."""

    names: List[str] = field(default_factory=list)
    params: List[nn.Parameter] = field(default_factory=list)
    owners: List[nn.Module] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def group_dense_parameters(module: nn.Module, dense: Mapping[str, nn.Parameter],
                           group_bytes: int = DEFAULT_GROUP_BYTES) -> List[DenseGroup]:
    """One unit per module that directly holds dense parameters, in ``named_modules`` order; a unit of
    ``group_bytes`` or more stands alone, smaller consecutive units are merged up to ``group_bytes``."""
    by_id = {id(p): n for n, p in dense.items()}
    groups: List[DenseGroup] = []
    small: Optional[DenseGroup] = None
    for _, mod in module.named_modules():
        own = [(by_id[id(p)], p) for p in mod.parameters(recurse=False) if id(p) in by_id]
        if not own:
            continue
        unit = DenseGroup([n for n, _ in own], [p for _, p in own], [mod])
        if unit.nbytes >= group_bytes:
            small = None
            groups.append(unit)
        elif small is not None and small.nbytes + unit.nbytes <= group_bytes:
            small.names += unit.names
            small.params += unit.params
            small.owners += unit.owners
        else:
            small = unit
            groups.append(unit)
    covered = {id(p) for g in groups for p in g.params}
    missing = [n for n, p in dense.items() if id(p) not in covered]
    if missing:
        raise ValueError(f"dense parameters {missing} are not held by any module of the model")
    return groups


class ForwardOrderedDenseSync:
    """``DistributedModelParallel(data_parallel_wrapper=ForwardOrderedDenseSync())`` instead of DDP.

    After :meth:`wrap`, build the dense optimizer with :meth:`dense_optimizer` (each group steps when its
    sum has arrived). The wrapper is kept on the DMP as ``dmp.dense_sync``; :meth:`settle_all` applies
    every pending update (called by ``state_dict`` / ``load_state_dict`` hooks and the optimizer's state).
    """

    def __init__(self, group_bytes: int = DEFAULT_GROUP_BYTES) -> None:
        self.group_bytes = group_bytes
        self.groups: List[DenseGroup] = []
        self._pg: Optional[dist.ProcessGroup] = None
        self._world = 1
        self._optims: List[KeyedOptimizer] = []
        self._pending: List[Optional[Tuple[torch.Tensor, Any]]] = []  # per group: (sum buffer, work) in flight
        self._requested: List[bool] = []  # per group: optimizer.step() was called for the sum in flight
        self._fired: List[int] = []  # per group: parameters whose gradient this backward has accumulated

    # ------------------------------------------------------------------ DataParallelWrapper
    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        module = dmp._dmp_wrapped_module
        sharded = set(DistributedModelParallel._sharded_parameter_names(module))
        # as TorchRec's DDP wrapper: every parameter outside sharded modules (and none with a fused optimizer)
        dense = {n: p for n, p in module.named_parameters()
                 if n not in sharded and not hasattr(p, "_in_backward_optimizers")}
        dmp.dense_sync = self
        if not dense or env.process_group is None:
            return
        pg = env.process_group
        ranks = dist.get_process_group_ranks(pg)
        # own group: the dense sums travel beside the embeddings' collectives instead of queueing before them
        self._pg = dist.new_group(ranks=ranks, backend=dist.get_backend(pg))
        self._world = len(ranks)
        self.groups = group_dense_parameters(module, dense, self.group_bytes)
        self._pending = [None] * len(self.groups)
        self._requested = [False] * len(self.groups)
        self._fired = [0] * len(self.groups)
        with torch.no_grad():  # as DDP does at construction: every rank starts from rank 0's dense weights
            for p in dense.values():
                dist.broadcast(p.data, src=ranks[0], group=self._pg)
        for i, g in enumerate(self.groups):  # every read of a group's weights settles its pending update
            for name, p in zip(g.names, g.params):
                p.register_post_accumulate_grad_hook(lambda _, i=i, name=name: self._on_grad(i, name))
            for owner in g.owners:
                owner.register_forward_pre_hook(lambda *_, i=i: self.settle(i))
                owner.register_state_dict_pre_hook(lambda *_, i=i: self.settle(i))
                owner.register_load_state_dict_pre_hook(lambda *_, i=i: self.settle(i))
        logger.info("dense sync: %d groups of %s bytes, summed in forward order",
                    len(self.groups), [g.nbytes for g in self.groups])

    # ------------------------------------------------------------------ optimizer
    def dense_optimizer(self, factory: Callable[[List[nn.Parameter]], torch.optim.Optimizer]) -> "DeferredDenseOptimizer":
        """The dense optimizer (one ``factory`` optimizer per group), stepping each group when it settles."""
        self._optims = [KeyedOptimizerWrapper(dict(zip(g.names, g.params)), factory)
                        for g in self.groups]
        return DeferredDenseOptimizer(self)

    def _on_grad(self, i: int, name: str) -> None:
        """Post-accumulate-grad hook of group ``i``'s parameter ``name``: the group's sum starts in
        backward once each of its parameters has its gradient (each is read once per forward)."""
        if self._pending[i] is not None:
            if not self._requested[i]:
                raise RuntimeError(f"dense parameter '{name}' received a second gradient in one backward; "
                                   "planner.dense_sync=forward_ordered needs each dense parameter read once per "
                                   "forward (use planner.dense_sync=ddp)")
            raise RuntimeError(f"dense parameter '{name}' was read before its last update was applied: it is "
                               "used outside the forward of the module that holds it (shared weights?); "
                               "planner.dense_sync=forward_ordered cannot see such reads (use planner.dense_sync=ddp)")
        self._fired[i] += 1
        if self._fired[i] == len(self.groups[i].params):
            self._start(i)

    def _start(self, i: int) -> None:
        g = self.groups[i]
        self._fired[i] = 0
        flat = _flatten_dense_tensors([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
        flat.div_(self._world)  # averaged over ranks as DDP does: divide, then sum
        with traffic_tag("dense_allreduce"):
            work = dist.all_reduce(flat, group=self._pg, async_op=True)
        self._pending[i] = (flat, work)
        self._requested[i] = False

    def start_all(self) -> None:
        """The optimizer step: every group's update is requested; a group whose sum did not start in
        backward (a layer without gradients) starts now, in forward order."""
        for i in range(len(self.groups)):
            if self._pending[i] is not None and self._requested[i]:
                self.settle(i)  # a layer that did not run since its last update
            if self._pending[i] is None:
                self._start(i)
            self._requested[i] = True

    def settle(self, i: int) -> None:
        """Wait for group ``i``'s sum and apply its optimizer step (no-op unless one was requested)."""
        pending = self._pending[i]
        if pending is None or not self._requested[i]:
            return
        self._pending[i] = None
        flat, work = pending
        work.wait()
        g = self.groups[i]
        for p, grad in zip(g.params, _unflatten_dense_tensors(flat, g.params)):
            p.grad = grad
        self._optims[i].step()
        for p in g.params:  # the coming backward accumulates from zero, as after zero_grad
            p.grad = None

    def settle_all(self) -> None:
        for i in range(len(self.groups)):
            self.settle(i)

    @property
    def pending(self) -> int:
        """Groups whose sum is in flight."""
        return sum(p is not None for p in self._pending)


class DeferredDenseOptimizer(CombinedOptimizer):
    """The dense optimizer of :class:`ForwardOrderedDenseSync`: ``step()`` starts the groups' sums, each
    group's own optimizer steps when its sum is waited for. Its state (checkpoints) is settled first."""

    def __init__(self, sync: ForwardOrderedDenseSync) -> None:
        super().__init__(list(sync._optims))
        self._sync = sync

    def step(self, closure: Any = None) -> None:
        self._sync.start_all()

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        self._sync.settle_all()
        return super().state
