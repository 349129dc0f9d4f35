"""Forward-ordered dense gradient sums: a TorchRec ``DataParallelWrapper`` that replaces DDP's wait.

DDP waits for every dense gradient's all-reduce at the end of backward, yet the next forward needs a
layer's weights only when it reaches that layer. Here the optimizer step starts each group of layers'
sum, in forward order, on a process group of its own, and each sum is waited for and applied (an
optimizer step over that group, and over any other group whose sum has arrived) just before that
group's next forward. Exact: the same averaged gradients and the same per-parameter updates as DDP +
the dense optimizer, applied before any read of the weights (forward, ``state_dict``,
``load_state_dict``, the optimizer's state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

from torchrec_herald.comm import LocalWork, all_reduce_async

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[List[nn.Parameter]], torch.optim.Optimizer]

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
    sum has arrived; groups whose sums have all arrived step together, in one optimizer call), or
    :func:`dense_optimizer_for`. The wrapper is kept on the DMP as ``dmp.dense_sync``.
    A group's pending update is applied by the forward, ``state_dict`` and ``load_state_dict`` pre-hooks
    of its layers; :meth:`settle_all` (the optimizer's state) applies every one.
    """

    def __init__(self, group_bytes: int = DEFAULT_GROUP_BYTES) -> None:
        self.group_bytes = group_bytes
        self.groups: List[DenseGroup] = []
        self._pg: Optional[dist.ProcessGroup] = None
        self._world = 1
        self._optim: Optional[KeyedOptimizer] = None  # one optimizer, one param group per dense group
        # per group: (sum buffer, work) in flight; at one rank (the gradients, LocalWork)
        self._pending: List[Optional[Tuple[Union[torch.Tensor, List[torch.Tensor]], Any]]] = []
        self._reached: List[bool] = []  # per group: its layers' forward ran since the sums were last started
        #: start each group's sum inside backward, once its gradients are complete (backward order), instead
        #: of at the optimizer step (forward order): the link carries them while backward computes. The
        #: herald pipeline sets it where it sends no gradient after backward (HET's plan, s >= 1)
        self.start_in_backward = False
        self._arrived: List[set] = []  # per group: its parameters whose gradient this backward completed
        self._early: List[bool] = []  # per group: its sum was started in this backward

    # ------------------------------------------------------------------ DataParallelWrapper
    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        # as TorchRec's DDP wrapper: the dense layers (built on CPU) go to the rank's device here
        module = dmp._dmp_wrapped_module.to(device)
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
        self._reached = [False] * len(self.groups)
        self._arrived = [set() for _ in self.groups]
        self._early = [False] * len(self.groups)
        with torch.no_grad():  # as DDP does at construction: every rank starts from rank 0's dense weights
            for p in dense.values():
                dist.broadcast(p.data, src=ranks[0], group=self._pg)
        for i, g in enumerate(self.groups):  # every read of a group's weights settles its pending update
            for owner in g.owners:
                owner.register_forward_pre_hook(lambda *_, i=i: self._reach(i))
                owner.register_state_dict_pre_hook(lambda *_, i=i: self.settle(i))
                owner.register_load_state_dict_pre_hook(lambda *_, i=i: self.settle(i))
            for p in g.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._gradient_done(i, p))
        logger.info("dense sync: %d groups of %s bytes, summed in forward order",
                    len(self.groups), [g.nbytes for g in self.groups])

    # ------------------------------------------------------------------ optimizer
    def dense_optimizer(self, factory: OptimizerFactory) -> "DeferredDenseOptimizer":
        """The dense optimizer, stepping each group when it settles: one ``factory`` optimizer over every
        dense parameter (as DDP's), so one ``step`` updates every group whose sum has arrived; the other
        parameters' gradients are kept out of that step (:meth:`settle`)."""
        named = {n: p for g in self.groups for n, p in zip(g.names, g.params)}
        self._optim = KeyedOptimizerWrapper(named, factory)
        return DeferredDenseOptimizer(self)

    def _start(self, i: int) -> None:
        g = self.groups[i]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params]
        for p in g.params:  # the sum owns the gradients now; a gradient seen later was made after this step
            p.grad = None
        if self._world == 1:  # one rank: the sum is the gradients themselves (no flatten, no collective)
            self._pending[i] = (grads, LocalWork())
            return
        flat = _flatten_dense_tensors(grads)
        flat.div_(self._world)  # averaged over ranks as DDP does: divide, then sum
        self._pending[i] = (flat, all_reduce_async(flat, self._pg, "dense_allreduce"))

    def _gradient_done(self, i: int, p: nn.Parameter) -> None:
        """Inside backward: ``p``'s gradient is accumulated; with :attr:`start_in_backward`, group ``i``'s
        sum starts once every parameter of it has its gradient (its layers ran their forward)."""
        if not self.start_in_backward or self._early[i]:
            return
        self._arrived[i].add(id(p))
        # (its forward's pre-hook, which set _reached, settled the sum of the step before: none is in flight)
        if len(self._arrived[i]) == len(self.groups[i].params) and self._reached[i]:
            self._arrived[i].clear()
            self._start(i)
            self._early[i] = True

    def start_all(self) -> None:
        """The optimizer step: start every group's gradient sum not started in backward, in forward order.
        By default none is: a sum started inside backward would share the link with the gradients herald
        sends after backward (hot replication's hot-row sum, the exact plan's reduce), which the next step
        needs first (RESULTS.md: slower at 50 Mbit/s); HET's plan sends none and sets
        :attr:`start_in_backward`."""
        for i, g in enumerate(self.groups):
            self._arrived[i].clear()
            if self._early[i]:  # started in backward: a gradient made after that came from a second use
                self._early[i] = False
                self._reached[i] = False
                late = [n for n, p in zip(g.names, g.params) if p.grad is not None]
                if late:
                    raise RuntimeError(f"dense parameter '{late[0]}' got a gradient after its group's sum started "
                                       "in backward: it is used more than once per forward (shared weights?); "
                                       "use planner.dense_sync=ddp")
                continue
            if not self._reached[i]:  # the group's layers did not run since the sums were last started ...
                used = [n for n, p in zip(g.names, g.params) if p.grad is not None]
                if used:  # ... yet its parameters got gradients: read elsewhere, maybe before their update
                    raise RuntimeError(f"dense parameter '{used[0]}' was read before its last update was applied: "
                                       "it is used outside the forward of the module that holds it (shared "
                                       "weights?); planner.dense_sync=forward_ordered cannot see such reads "
                                       "(use planner.dense_sync=ddp)")
                self.settle(i)
            self._start(i)
            self._reached[i] = False

    def _reach(self, i: int) -> None:
        """Group ``i``'s layers are about to run their forward: its update is applied first."""
        self._reached[i] = True
        self.settle(i)

    def settle(self, i: int) -> None:
        """Wait for group ``i``'s sum and apply its optimizer step (no-op if none is in flight), together
        with every other group whose sum has already arrived: one optimizer call where the groups' sums
        are all in (a GPU host pays each call's overhead), one per group where the link is the slower.
        Exact either way: each parameter gets the same update, once per step, before its next read."""
        if self._pending[i] is None:
            return
        ready = [i] + [j for j, p in enumerate(self._pending) if j != i and p is not None and p[1].is_completed()]
        # gradients the step must not see (other groups' local, not yet summed ones: a settle can run
        # between a backward and the sums' start), set aside for the step's length
        others = [p for j, g in enumerate(self.groups) if j not in ready for p in g.params if p.grad is not None]
        aside = [p.grad for p in others]
        for p in others:
            p.grad = None
        params: List[nn.Parameter] = []
        for j in ready:
            flat, work = self._pending[j]  # type: ignore[misc]
            self._pending[j] = None
            work.wait()
            g = self.groups[j]
            for p, grad in zip(g.params, flat if isinstance(flat, list) else _unflatten_dense_tensors(flat, g.params)):
                p.grad = grad
            params += g.params
        assert self._optim is not None
        self._optim.step()
        for p in params:  # the coming backward accumulates from zero, as after zero_grad
            p.grad = None
        for p, grad in zip(others, aside):
            p.grad = grad

    def settle_all(self) -> None:
        for i in range(len(self.groups)):
            self.settle(i)

    @property
    def pending(self) -> int:
        """Groups whose sum is in flight."""
        return sum(p is not None for p in self._pending)


class DeferredDenseOptimizer(CombinedOptimizer):
    """The dense optimizer of :class:`ForwardOrderedDenseSync`: ``step()`` starts the groups' sums, each
    group is stepped when its sum is waited for. Its state (checkpoints) is settled first."""

    def __init__(self, sync: ForwardOrderedDenseSync) -> None:
        assert sync._optim is not None
        super().__init__([sync._optim])
        self._sync = sync

    def step(self, closure: Any = None) -> None:
        self._sync.start_all()

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        self._sync.settle_all()
        return super().state


def dense_optimizer_for(dmp: Any, factory: OptimizerFactory) -> KeyedOptimizer:
    """The dense optimizer of ``dmp``: :class:`DeferredDenseOptimizer` where a
    :class:`ForwardOrderedDenseSync` wrapped dense layers, else TorchRec's ``KeyedOptimizerWrapper`` over
    the parameters without a fused optimizer (DDP's)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    sync = getattr(dmp, "dense_sync", None)
    if sync is not None and sync.groups:
        return sync.dense_optimizer(factory)
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())), factory)


def dense_sync_wrapper(mode: str) -> Optional["ForwardOrderedDenseSync"]:
    """The DMP ``data_parallel_wrapper`` for ``planner.dense_sync``: ``forward_ordered`` (each layer's sum
    waited for at its next forward) or ``ddp`` (None: TorchRec's DDP wrapper)."""
    if mode not in ("ddp", "forward_ordered"):
        raise ValueError(f"unknown planner.dense_sync {mode!r}; expected one of ['ddp', 'forward_ordered']")
    return ForwardOrderedDenseSync() if mode == "forward_ordered" else None
