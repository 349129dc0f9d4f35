"""Herald's sharded EmbeddingBagCollection: hot rows replicated, cold rows row-wise with variable-size dists.

P²RES two-fold parallelism as a TorchRec ``ShardedModule``: every rank looks its hot ids up in a local
replica (hot-row gradients are all-reduced *before* one optimizer update that every replica applies
identically), and ships only its remote *cold* ids to their owners, which return one partial pooled
vector per non-empty (owner, feature, sample) sub-bag — and receive only those vectors' gradients.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    LazyNoWait,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
)
from torchrec.distributed.utils import convert_to_fbgemm_types, merge_fused_params, optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Multistreamable

from torchrec_herald.comm import (FLOAT_BYTES, INDEX_BYTES, RowsInFlight, all_reduce_async, all_to_all_rows_async,
                                   await_variable_all_to_all, ring_allreduce_bytes, start_variable_all_to_all)
from torchrec_herald.layout import RowLayout
from torchrec_herald.native import load_if_built
from torchrec_herald.ops.hot_cold import (HotColdSplit, bags_of_values, invalid_ids, key_offset_and_spare,
                                          offsets_from_lengths, out_of_table, split_hot_cold)
from torchrec_herald.ops.tbe import SUPPORTED_OPTIMIZERS, dense_lookup
from torchrec_herald.sharding.plan_exec import PlanExecutor
from torchrec_herald.sharding.row_store import RowStore, add_rows_in_order
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, HotSpec, feature_read_twice, hot_spec_of
from torchrec_herald.traffic import TrafficMeter, traffic_tag

logger = logging.getLogger(__name__)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale`` (TorchRec's gradient division)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:  # type: ignore[override]
        return grad * ctx.scale, None


def storage_device(device: Optional[torch.device]) -> torch.device:
    """Where herald keeps its rows: ``device`` (CPU when None), a CUDA device always with its index (the
    ShardedTensor placements of the state name it)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


#: the default of a context's id tensors: one shared empty tensor (a context is made every step; the
#: fields are only ever replaced, never written into)
_NO_IDS = torch.empty(0, dtype=torch.int64)


@dataclass
class HeraldContext(Multistreamable):
    """Per-batch state between input_dist, compute and output_dist."""

    batch_size: int = 0
    split: Optional[HotColdSplit] = None
    send_bag_index: torch.Tensor = _NO_IDS
    bags_to: List[int] = field(default_factory=list)  # sub-bags this rank sends to each owner
    bags_from: List[int] = field(default_factory=list)  # sub-bags each rank sends to this owner
    recv_lengths: torch.Tensor = _NO_IDS
    recv_rows: torch.Tensor = _NO_IDS
    # the hot rows this batch reads (sorted, unique), each hot id's position among them, and which of them
    # are synced sparsely (their count rides on the input dist's counts exchange)
    hot_unique: torch.Tensor = _NO_IDS
    hot_inverse: torch.Tensor = _NO_IDS
    # (positions among hot_unique, found in the input dist so that backward sizes nothing by the data)
    sparse_idx: torch.Tensor = _NO_IDS
    sparse_from: List[int] = field(default_factory=list)  # touched sparse-sync hot rows of each rank
    bag_lengths: torch.Tensor = _NO_IDS
    # plan mode: every lookup local, into the step's working set of rows (sorted keys)
    ws_index: Optional[torch.Tensor] = None
    ws_offsets: torch.Tensor = _NO_IDS

    def record_stream(self, stream: torch.Stream) -> None:
        """The batch's id tensors live on the rows' device, made on TorchRec's data-dist stream: tell the
        caching allocator the compute stream uses them too (as TorchRec's own contexts do)."""
        tensors = [self.send_bag_index, self.recv_lengths, self.recv_rows, self.hot_unique, self.hot_inverse,
                   self.sparse_idx, self.bag_lengths, self.ws_index, self.ws_offsets]
        if self.split is not None:
            tensors += [getattr(self.split, f) for f in ("hot_offsets", "bag_lengths", "sub_lengths", "bucketed_ids",
                                                         "bucketed_hot_rows")]
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(stream)


@dataclass(frozen=True)
class _LayoutOnDevice:
    """The lookup tables of a :class:`~torchrec_herald.layout.RowLayout` that the per-step id bookkeeping
    reads, copied once to the device that bookkeeping runs on (the rows'), with each hot row's sync mode."""

    device: torch.device
    rows_per_feature: torch.Tensor
    feature_table: torch.Tensor
    table_offsets: torch.Tensor
    hot_keys: torch.Tensor
    blocks_per_feature: torch.Tensor
    block_offsets: torch.Tensor
    hot_slot_table: torch.Tensor
    feature_offsets: torch.Tensor
    sparse_row: torch.Tensor  # per hot row: synced sparsely?
    owner_feature_offsets: torch.Tensor  # [W * F]: where feature f's table starts in owner o's cold block, at o * F + f
    feature_key_table: torch.Tensor  # [F, 2]: feature f's table offset in the key space, its spare bucket's first id

    @classmethod
    def of(cls, lay: RowLayout, sparse_row: torch.Tensor, device: torch.device) -> "_LayoutOnDevice":
        on = {f: getattr(lay, f).to(device) for f in ("rows_per_feature", "feature_table", "table_offsets",
                                                         "hot_keys", "blocks_per_feature", "block_offsets",
                                                         "hot_slot_table", "feature_offsets")}
        by_owner = lay.block_offsets[:, lay.feature_table].reshape(-1).to(device)
        keys = key_offset_and_spare(lay.table_offsets, lay.feature_table, lay.blocks_per_feature,
                                    lay.block_offsets.shape[0]).to(device)
        return cls(device=device, sparse_row=sparse_row.to(device), owner_feature_offsets=by_owner,
                   feature_key_table=keys, **on)


def _used_on_this_stream(*tensors: torch.Tensor) -> None:
    """Tensors made on the compute stream in backward and read here, on whatever stream settles the hot-row sum
    (TorchRec's data-dist stream, under its pipeline): the caching allocator must not hand their memory to the
    compute stream before this stream's reads run (``record_stream``; a CPU has no streams)."""
    if tensors and tensors[0].is_cuda:
        stream = torch.cuda.current_stream(tensors[0].device)
        for t in tensors:
            t.record_stream(stream)


@dataclass
class _PendingHotSync:
    """A hot-row gradient sum in flight: the collectives' (rows, buffer, work) for densely synced tables
    and (received rows, work) for sparsely synced ones."""

    dense: Optional[Tuple[torch.Tensor, torch.Tensor, Any]] = None
    sparse: Optional[Tuple[torch.Tensor, Any]] = None


class _IdsAwaitable(Awaitable[HeraldContext]):
    """Second stage of the herald input dist: the sub-bag lengths and ids in flight; waiting stores them."""

    def __init__(self, ctx: HeraldContext, recv: torch.Tensor, work: Any, sizes: List[int]) -> None:
        super().__init__()
        self._ctx, self._recv, self._work, self._sizes = ctx, recv, work, sizes

    def _wait_impl(self) -> HeraldContext:
        self._work.wait()
        parts = self._recv.split(self._sizes)
        one = len(parts) == 2  # one rank sent: its two parts are the lengths and the rows, no copy needed
        self._ctx.recv_lengths = parts[0] if one else torch.cat(parts[0::2])
        self._ctx.recv_rows = parts[1] if one else torch.cat(parts[1::2])
        return self._ctx


@dataclass
class _SplitSizes:
    """The input dist's sizes, still on the ids' device until the first wait reads them: ``sizes`` =
    [sub-bags to each owner | ids to each owner | hot rows read | of them synced sparsely], and the masks
    the data-sized tensors are cut from (hot rows read, those synced sparsely, non-empty sub-bags)."""

    sizes: torch.Tensor
    read: torch.Tensor
    read_sparse: torch.Tensor
    nonempty: torch.Tensor
    values: torch.Tensor  # the batch's ids, lengths and batch size: the first bad id is found from them only
    lengths: torch.Tensor  # when some rank flagged one (an error path)
    batch_size: int
    feature_of_value: Optional[torch.Tensor]  # each id's feature, where the split found it
    ids_per_owner_feature: torch.Tensor  # cold ids to each (owner, feature) ``[W * F]``, in the message's order

    def features(self) -> torch.Tensor:
        """Each id's feature."""
        if self.feature_of_value is None:
            self.feature_of_value = bags_of_values(self.lengths, self.values.numel()) // self.batch_size
        return self.feature_of_value


class _CountsAwaitable(Awaitable[Awaitable[HeraldContext]]):
    """First stage: the per-owner counts (and bad-id flags) in flight; waiting reads the sizes and starts
    the ids' exchange."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection", ctx: HeraldContext, recv_counts: torch.Tensor,
                 work: Any, sizes: _SplitSizes) -> None:
        super().__init__()
        self._module, self._ctx, self._recv_counts, self._work = module, ctx, recv_counts, work
        self._sizes = sizes

    def _wait_impl(self) -> Awaitable[HeraldContext]:
        self._work.wait()
        return self._module._ids_dist(self._ctx, self._recv_counts, self._sizes)


class _OneRankAwaitable(Awaitable[Awaitable[HeraldContext]]):
    """The one-rank input dist (:meth:`ShardedHeraldEmbeddingBagCollection._one_rank_input_dist`): the ids need
    no exchange. Its first wait reads whether any id is outside its table (the input dist's one host read, as
    the split path reads its sizes there) and raises it. TorchRec's pipeline makes that wait after it has
    queued the previous batch's forward and before its backward: outside any forward or backward, the
    kernels that made the flag long queued. The second wait, inside the batch's forward, reads nothing."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection", ctx: HeraldContext, any_bad: torch.Tensor,
                 values: torch.Tensor, features: torch.Tensor) -> None:
        super().__init__()
        self._module, self._ctx, self._any_bad, self._values, self._features = module, ctx, any_bad, values, features

    def _wait_impl(self) -> Awaitable[HeraldContext]:
        if bool(self._any_bad):
            self._module._raise_on_bad_ids([0], self._values, self._features)
        return NoWait(self._ctx)


@dataclass
class _Message:
    """What the input dist sends once the sizes are read: the packed lengths and ids, the rows to each
    rank and the sizes from each (``[lengths, ids]`` per rank); or the ranks with a bad id."""

    sizes: _SplitSizes
    bad_ranks: List[int]
    packed: Optional[torch.Tensor] = None
    send: List[int] = field(default_factory=list)
    recv_sizes: List[int] = field(default_factory=list)


@dataclass
class _HandOff:
    """An input dist whose host work runs on the module's worker thread: its context, the stream its
    kernels go on, the worker's split (counts and sizes) and, once the counts are sent, its message."""

    ctx: HeraldContext
    stream: Optional[torch.cuda.Stream]
    split: "Future[Tuple[torch.Tensor, _SplitSizes]]"
    message: "Optional[Future[_Message]]" = None


def _stream_of(stream: Optional[torch.cuda.Stream]) -> Any:
    """``stream`` made current on its device (a no-op context without one)."""
    if stream is None:
        return contextlib.nullcontext()
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.cuda.device(stream.device))
    ctx.enter_context(torch.cuda.stream(stream))
    return ctx


def _on_stream(stream: Optional[torch.cuda.Stream], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with ``stream`` current (a worker thread's current stream is its own)."""
    with _stream_of(stream):
        return fn(*args)


class _HandOffAwaitable(Awaitable[Awaitable[HeraldContext]]):
    """First stage of a handed-off input dist: waiting (training thread) sends its counts if still pending,
    joins the worker's message (an exception there, raised here) and sends the ids."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection", handoff: _HandOff) -> None:
        super().__init__()
        self._module, self._handoff = module, handoff

    def _wait_impl(self) -> Awaitable[HeraldContext]:
        return self._module._finish_handoff(self._handoff)


def _check_every_rank_has_the_plan(tables: List[str], specs: List[HotSpec], pg: Optional[dist.ProcessGroup],
                                   world: int, device: torch.device) -> None:
    """Every rank shards with the same hot sets (collective: one small all-gather as the module is built). A plan
    made on each rank from its own batches (``HeraldPlanner.plan`` there, not ``collective_plan``) can pick
    other rows on each, and the ranks' collectives would then not match (gloo aborts, NCCL hangs): ValueError on
    every rank naming the first table that differs, instead."""
    if world < 2:
        return
    digest = torch.tensor([[s.hot_ids.numel(), int(s.hot_ids.sum()), int((s.hot_ids * s.hot_ids).sum()),
                            zlib.crc32(str(s.sync).encode())] for s in specs], dtype=torch.int64, device=device)
    every = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(every, digest, group=pg)
    for t, name in enumerate(tables):
        if any(not torch.equal(every[0][t], other[t]) for other in every[1:]):
            counts = [int(d[t, 0]) for d in every]
            raise ValueError(f"table {name}: the ranks shard it with different hot sets ({counts} hot rows by rank, "
                             f"or other rows): every rank must use one plan. Plan with HeraldPlanner.collective_plan"
                             f"(model, sharders, pg) (rank 0 plans, every rank gets its plan), as TorchRec's planner")


#: fbgemm TBE optimizer arguments that can change SGD's or row-wise Adagrad's update, and the value at which they do
#: not: herald's cold lookup and hot-row update would ignore any other value, training silently otherwise
#: (``weight_decay`` acts only with a ``weight_decay_mode`` other than NONE, fbgemm's default: see
#: :func:`_settings_not_reproduced`)
UPDATE_KEYS_NOT_REPRODUCED: Dict[str, Any] = {
    "gradient_clipping": False, "max_norm": 0.0, "counter_based_regularization": None,
    "cowclip_regularization": None, "global_weight_decay": None}


def _settings_not_reproduced(params: Dict[str, Any]) -> List[str]:
    """The settings in ``params`` (fused params, fbgemm's names) that would change the update herald makes."""
    changed = [f"{k}={params[k]!r}" for k, default in UPDATE_KEYS_NOT_REPRODUCED.items()
               if k in params and params[k] is not None and params[k] != default]
    mode = params.get("weight_decay_mode")
    if params.get("weight_decay") and mode is not None and int(getattr(mode, "value", mode)) != 0:
        changed.append(f"weight_decay={params['weight_decay']!r} with weight_decay_mode={getattr(mode, 'name', mode)}")
    return changed


def fused_params_of(module: EmbeddingBagCollection, sharder_fused_params: Optional[Dict[str, Any]]
                    ) -> Dict[str, Any]:
    """The embedding optimizer, set the TorchRec way: ``apply_optimizer_in_backward`` on the EBC's
    weights (``_optimizer_classes``/``_optimizer_kwargs``) and/or the sharder's ``fused_params``."""
    merged: Optional[Dict[str, Any]] = None
    for name, param in module.named_parameters():
        classes = getattr(param, "_optimizer_classes", [None])
        kwargs = dict(getattr(param, "_optimizer_kwargs", [{}])[0])
        if classes[0] is not None and "optimizer" not in kwargs:
            kwargs["optimizer"] = optimizer_type_to_emb_opt_type(classes[0])
        params = convert_to_fbgemm_types(merge_fused_params(sharder_fused_params, kwargs))
        if "lr" in params:
            params["learning_rate"] = params.pop("lr")
        if merged is not None and params != merged:
            raise ValueError(f"herald needs one embedding optimizer for all tables; {name} has {params}, "
                             f"others {merged}")
        merged = params
    if not merged or "optimizer" not in merged:
        raise ValueError("no embedding optimizer: use torchrec.optim.apply_optimizer_in_backward on the "
                         "EmbeddingBagCollection's parameters or the sharder's fused_params={'optimizer': ...}")
    tables = ", ".join(c.name for c in module.embedding_bag_configs())
    changed = _settings_not_reproduced(merged)
    if changed:  # (the cold TBE and the hot rows' update take the optimizer, its learning rate and eps alone)
        raise ValueError(f"herald_hot_row_wise does not reproduce the embedding optimizer's {', '.join(changed)} (the "
                         f"EBC of tables {tables}): drop it from fused_params / apply_optimizer_in_backward's "
                         f"arguments, or keep these tables stock (ParameterConstraints(sharding_types=[...]) without "
                         f"row_wise, given to HeraldPlanner)")
    if merged["optimizer"] not in SUPPORTED_OPTIMIZERS:
        raise ValueError(f"herald_hot_row_wise reproduces {[o.name for o in SUPPORTED_OPTIMIZERS]} exactly; the EBC "
                         f"of tables {tables} uses {merged['optimizer']}: use SGD or RowWiseAdagrad, or keep these "
                         f"tables stock (ParameterConstraints(sharding_types=[...]) without row_wise, given to "
                         f"HeraldPlanner)")
    return merged


class HeraldFusedOptimizer(FusedOptimizer):
    """The herald EBC's embedding optimizer as TorchRec sees it: cold rows are updated in backward (fused
    TBE); the hot rows' gradient sum, started there by a hook, is applied by the next use of the rows or
    of this optimizer's state; ``step`` and ``zero_grad`` apply a changed learning rate (``param_groups[0]["lr"]``,
    as TorchRec's fused optimizer and torch's LR schedulers set it) and nothing else. Its state is each table's
    row-wise Adagrad ``momentum1`` as a ShardedTensor in stock ROW_WISE's layout (keys as stock's), so
    optimizer state moves between herald and stock ROW_WISE models like TorchRec's own."""

    def __init__(self, module: "ShardedHeraldEmbeddingBagCollection") -> None:
        params: Dict[str, Any] = {}
        state: Dict[Any, Any] = {}
        store = module.store
        for t, name in enumerate(module.layout.tables):
            weight = module.sharded_block(t, store.cold_block(t))
            params[f"embedding_bags.{name}.weight"] = weight
            momentum = store.cold_block_state(t)
            state[weight] = {} if momentum is None else {f"{name}.momentum1": module.sharded_block(t, momentum)}
        super().__init__(params, state, [{"params": list(params.values()), "lr": store.lr}])
        self._module, self._lr = module, store.lr

    def _apply_learning_rate(self) -> None:
        """A learning rate changed in ``param_groups`` takes effect from the next update; a hot-row update still
        in flight (the last step's) applies the rate it was computed under (:meth:`set_learning_rate`)."""
        lr = float(self.param_groups[0]["lr"])
        if lr != self._lr:
            self._module.set_learning_rate(lr)
            self._lr = lr

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._apply_learning_rate()

    @property  # type: ignore[override]
    def state(self) -> Dict[Any, Any]:
        """The optimizer state; a hot-row update still in flight is applied first (its rows' state is
        mirrored into these blocks then)."""
        module = self.__dict__.get("_module")
        if module is not None:
            module._check_flushed("the fused optimizer's state (its state_dict())")
            module.store.flush_mirror()  # (settles the hot sync first) the blocks' hot-row state up to date
        return self.__dict__["_herald_state"]

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self.__dict__["_herald_state"] = value

    def step(self, closure: Any = None) -> None:
        """Cold rows were updated inside backward. The hot rows' gradient sum, started there, is applied
        at the rows' next use (:attr:`ShardedHeraldEmbeddingBagCollection.store`), not here: it travels
        while the dense layers step and the next batch starts."""
        self._apply_learning_rate()

    def post_load_state_dict(self) -> None:
        self._module.refresh_hot_from_blocks()


class ShardedHeraldEmbeddingBagCollection(
    ShardedModule[HeraldContext, Tuple[torch.Tensor, Optional[RowsInFlight], torch.Tensor], KeyedTensor, HeraldContext],
    FusedOptimizerModule,
):
    """Sharded EBC of the herald sharding type (built by ``HeraldEmbeddingBagCollectionSharder``).

    Storage per rank: one fused TBE over its row-wise cold blocks of all tables (the stock ROW_WISE
    block layout, ``ceil(n/W)`` rows per rank) and one dense TBE over the hot replicas of all tables.
    ``state_dict()`` presents every table as ``embedding_bags.<table>.weight``: a ShardedTensor in stock
    ROW_WISE's layout over the rank's cold blocks, which hold every row's current value (hot rows mirrored into
    them), so checkpoints load into stock-sharded or unsharded models.
    """

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, device: Optional[torch.device] = None,
                 fused_params: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        self._env = env
        self._pg = env.process_group
        self._world, self._rank = env.world_size, env.rank
        self._device = storage_device(device)
        configs = module.embedding_bag_configs()
        dims = {c.embedding_dim for c in configs}
        if len(dims) != 1:
            by_dim = {d: [c.name for c in configs if c.embedding_dim == d] for d in sorted(dims)}
            raise ValueError(f"herald sharding needs one embedding dim for all its tables, got "
                             f"{'; '.join(f'dim {d}: {names}' for d, names in by_dim.items())} (plan the tables of "
                             f"the other dims with a stock sharding type, or in an EBC of their own)")
        self._dim = dims.pop()
        self._mean_features = torch.tensor([c.pooling == PoolingType.MEAN for c in configs for _ in c.feature_names],
                                           device=self._device)  # where output_dist scales the bags
        for c in configs:
            if c.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {c.name}: pooling {c.pooling} not supported (SUM, MEAN)")
        specs: List[HotSpec] = []
        for c in configs:
            ps = table_name_to_parameter_sharding[c.name]
            spec = hot_spec_of(ps)
            if ps.sharding_type != HERALD_HOT_ROW_WISE or spec is None:
                raise ValueError(f"table {c.name}: expected a HeraldParameterSharding of type "
                                 f"{HERALD_HOT_ROW_WISE}, got {type(ps).__name__} {ps.sharding_type}")
            if spec.hot_ids.numel() and (spec.hot_ids[0] < 0 or spec.hot_ids[-1] >= c.num_embeddings):
                raise ValueError(f"table {c.name}: hot ids outside [0, {c.num_embeddings})")
            specs.append(spec)
        _check_every_rank_has_the_plan([c.name for c in configs], specs, self._pg, self._world, self._device)
        self._syncs = [s.sync for s in specs]
        self._fused_params = fused_params_of(module, fused_params)
        self._optimizer: EmbOptimType = self._fused_params["optimizer"]
        twice = feature_read_twice(configs)
        if twice is not None:
            raise ValueError(f"herald sharding maps a feature to one table; feature {twice[0]!r} is read by tables "
                             f"{twice[1]!r} and {twice[2]!r} (keep one of them stock, or in an EBC of its own)")

        # the global row space (P²RES hot/cold layout) and this rank's rows
        self.layout = RowLayout.build(self._world, {c.name: c.num_embeddings for c in configs},
                                      {c.name: spec.hot_ids for c, spec in zip(configs, specs)},
                                      features={f: c.name for c in configs for f in c.feature_names})
        lay = self.layout
        self._tables, self._num_embeddings = list(lay.tables), list(lay.num_embeddings)
        self._feature_names: List[str] = list(lay.features)
        self._num_hot = lay.num_hot
        # fbgemm's dense TBE draws its placeholder weights from the global generator (torch.randn): build
        # the storage on a forked generator, so the rows below draw exactly what stock TorchRec draws
        # (and on this rank's GPU: fbgemm's dense TBE takes the current CUDA device, which a user passing
        # cuda:LOCAL_RANK to the sharded model need not have set)
        on_gpu = self._device.type == "cuda"
        with torch.random.fork_rng(devices=[self._device] if on_gpu else []), \
                (torch.cuda.device(self._device) if on_gpu else contextlib.nullcontext()):
            self._store = RowStore(lay, self._rank, self._dim, self._fused_params, self._device)
        self._configs = list(configs)
        self._pending_hot: Optional[_PendingHotSync] = None  # hot-row gradient sum in flight
        self._lr_after_settle: Optional[float] = None  # herald's own rate once that sum is applied
        for p in self._store.parameters():
            p._in_backward_optimizers = [EmptyFusedOptimizer()]  # updated in backward: keep dense optimizers off
        self._optim: FusedOptimizer = HeraldFusedOptimizer(self)
        # plan mode (HeraldTrainPipeline): the executor holds the step's plan and working set
        self._executor: Optional[PlanExecutor] = None
        # bytes this rank sends per table, by the same formulas as TrafficMeter (cross-checked in tests)
        self._traffic = torch.zeros(len(self._tables), 4, dtype=torch.float64)  # ids, pooled, grads, hot_sync
        self._cold_sent = torch.zeros(2, self._world, len(self._feature_names), dtype=torch.int64,
                                      device=self._device)  # ids, bags
        sparse_table = torch.tensor([m == "sparse" for m in self._syncs], dtype=torch.bool)
        self._sparse_row = sparse_table[lay.hot_slot_table]  # per hot row: synced sparsely?
        self._any_sparse, self._any_mean = bool(self._sparse_row.any()), bool(self._mean_features.any())
        self._all_dense_rows = (~self._sparse_row).nonzero().flatten()
        # the per-step id bookkeeping (validation, hot/cold split, owner buckets) runs where the rows are:
        # on a GPU the batch's ids never go to the host; the layout's lookup tables are copied there once
        self._ids = _LayoutOnDevice.of(lay, self._sparse_row, self._device)
        #: the id bookkeeping in one compiled pass (native/id_split.cpp) where the ids are on the CPU and
        #: the extension is built; else the torch ops of ops/hot_cold.py (the reference)
        self._native_ids: Optional[Any] = load_if_built() if self._ids.device.type == "cpu" else None
        # sparsely synced hot rows sent, per hot slot (mapped to tables when read: one launch a step, not three)
        self._hot_sparse_sent = torch.zeros(max(self._num_hot, 1), dtype=torch.int64, device=self._device)
        self._one = torch.ones((), dtype=torch.int64, device=self._device)  # the counts' source, expanded
        # the input dist's hot-row counts where the module holds no hot rows (made once, only ever read)
        self._no_hot_counts = torch.zeros(max(self._world, 2), dtype=torch.int64, device=self._device)
        self._no_rows_read = torch.zeros(0, dtype=torch.bool, device=self._device)
        self._feature_of_bag_cache: Dict[int, torch.Tensor] = {}
        # the per-step input dist's worker thread (its host work only), made at its first use
        self._in_thread: Optional[bool] = None
        self._worker: Optional[ThreadPoolExecutor] = None
        self._pending_dist: Optional[_HandOff] = None  # an input dist whose counts the training thread has not sent
        # stale-update skipping: no hot row frozen yet (the frozen mask, the rows whose reads ride on the counts
        # exchange and the densely synced rows follow from it)
        self.set_frozen_hot(None)
        if any(p.is_meta for p in module.parameters()):
            self.reset_parameters()  # built on meta, as large models are: initialise as stock TorchRec does
        else:
            self._load_full({c.name: module.embedding_bags[c.name].weight.detach() for c in configs})
        logger.info("herald EBC rank %d: %d tables, %d cold rows, %d hot rows (%s sync), optimizer %s",
                    self._rank, len(configs), sum(self.store.block_rows), self._num_hot, "/".join(sorted(set(self._syncs))),
                    self._optimizer.name)

    # ------------------------------------------------------------------ what the pipeline reads
    @property
    def store(self) -> RowStore:
        """This rank's rows (hot replicas, cold block, cache), the hot replicas' pending update applied
        first (:meth:`settle_hot_sync`): every use of the rows goes through here."""
        self.settle_hot_sync()
        return self._store

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self._pg

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def embedding_dim(self) -> int:
        return self._dim

    # ------------------------------------------------------------------ ShardedModule API
    def create_context(self) -> HeraldContext:
        return HeraldContext()

    def input_dist(self, ctx: HeraldContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[HeraldContext]]:
        """Split ids hot/cold, validate them, and send the remote cold ids to their owners: an awaitable
        of an awaitable, as a stock input dist (first wait: the counts arrived, the ids are sent; second:
        the ids arrived). An id outside its table is raised by every rank at the first wait.

        The previous step's hot-row gradient sum is applied here first: a pipelined input dist runs
        before the next forward, so the merge of the rows it received (``torch.unique``, sized by the
        data) happens outside forward and backward."""
        self.settle_hot_sync()
        features = self.in_feature_order(features)
        if features.weights_or_none() is not None:
            raise ValueError(f"the KJT this EBC reads carries per-sample weights; {self.no_weights()}")
        B = features.stride()
        if self._executor is not None and self._executor.active:
            values, lengths = self._ids_of(ctx, features, B)
            return self._plan_input_dist(ctx, values, lengths, B)
        self._check_flushed("a forward outside HeraldTrainPipeline.progress()")
        if self._world == 1 and not self._num_hot:
            return KJTListSplitsAwaitable([self._one_rank_input_dist(ctx, features, B)], ctx)
        if self.input_dist_in_thread:
            return self._input_dist_in_worker(ctx, features, B)
        return KJTListSplitsAwaitable([self._start_input_dist(ctx, features, B)], ctx)

    def _one_rank_input_dist(self, ctx: HeraldContext, features: KeyedJaggedTensor, B: int) -> "_OneRankAwaitable":
        """One rank and no hot rows: every id's row is in this rank's block, so nothing is split, counted or
        sent (as TorchRec's input dist returns its input at one worker). Each id becomes its row (its feature's
        offset in the block plus the id; one outside its table reads row 0 until the first wait raises it) and
        the cold lookup pools every bag, empty ones to zeros, in the output's bag order: no message, no
        scatter of the pooled vectors. About 11 ops where the split and the message took some 35 (a GPU's
        step is its host's)."""
        values, lengths = self._ids_of(ctx, features, B)
        lay = self._ids
        feature_of_value, bad = self._features_and_bad(values, lengths, B)
        rows = lay.owner_feature_offsets.index_select(0, feature_of_value) + values.masked_fill(bad, 0)
        # int32: the wire's index type, which the cold lookup takes as it is (module docstring of compute)
        ctx.recv_rows, ctx.recv_lengths = rows.to(torch.int32), lengths.to(torch.int32)
        return _OneRankAwaitable(self, ctx, bad.any(), values, feature_of_value)

    def _ids_of(self, ctx: HeraldContext, features: KeyedJaggedTensor, B: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The batch's values and lengths as int64 where the rows are: the id bookkeeping (validation, hot/cold
        split, owner buckets, counts; in plan mode each id's place in the working set) runs there."""
        dev = self._ids.device
        values, lengths = features.values().to(dev, torch.int64), features.lengths().to(dev, torch.int64)
        ctx.batch_size, ctx.bag_lengths = B, lengths
        return values, lengths

    @property
    def input_dist_in_thread(self) -> bool:
        """Whether the per-step input dist's host work runs on a worker thread of the module's own (default:
        where the ids are on a GPU, whose step is its host's: the id bookkeeping's kernel launches are queued
        by the worker while the training thread queues the previous batch's forward). On a CPU the kernels
        are the host's own work, so the default there keeps one thread."""
        if self._in_thread is None:
            return self._ids.device.type == "cuda"
        return self._in_thread

    @input_dist_in_thread.setter
    def input_dist_in_thread(self, on: Optional[bool]) -> None:
        """``True``/``False``: on a worker thread or not; ``None``: the default (on a GPU)."""
        self._in_thread = on

    def _input_dist_in_worker(self, ctx: HeraldContext, features: KeyedJaggedTensor, B: int
                              ) -> KJTListSplitsAwaitable:
        """Hand the input dist's host work to the module's worker thread; its collectives stay here.

        The worker splits the ids and counts them now, and later (:meth:`_send_pending_counts`) reads the
        sizes and builds the message. The training thread sends the counts at this module's next output
        dist (or at the first wait, if that comes first) and the ids at the first wait. So every collective
        is issued from the training thread in program order, the same on every rank. NCCL's guide warns
        that kernels of communicators queued from two threads in different orders on different ranks can
        deadlock; this order cannot differ. The worker queues its kernels on the stream this call is made on
        (TorchRec's data-dist stream), which TorchRec's pipeline joins to the compute stream, as for a stock
        input dist."""
        self._send_pending_counts()  # one started before, whose counts are still here: they go first
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="herald-input-dist")
        stream = torch.cuda.current_stream(self._ids.device) if self._ids.device.type == "cuda" else None
        # (its waits count in the meters of the step that handed it the split, not another run's or none)
        handoff = _HandOff(ctx, stream, self._worker.submit(TrafficMeter.counted_here(_on_stream), stream,
                                                            self._split_for_dist, ctx, features, B))
        self._pending_dist = handoff
        return KJTListSplitsAwaitable([_HandOffAwaitable(self, handoff)], ctx)

    def _send_pending_counts(self) -> None:
        """The training thread's side of a handed-off input dist: wait for the worker's split, send its
        counts, and hand the reading of the sizes and the message to the worker. No-op if none is pending."""
        h, self._pending_dist = self._pending_dist, None
        if h is None:
            return
        counts, sizes = h.split.result()
        with _stream_of(h.stream):
            recv_counts, work = self._exchange_counts(counts)
        h.message = self._worker.submit(_on_stream, h.stream, self._message_for_dist, h.ctx, recv_counts, work, sizes)

    def _finish_handoff(self, h: "_HandOff") -> Awaitable[HeraldContext]:
        """The first wait of a handed-off input dist (training thread): its counts sent if still pending,
        the worker's message joined, then the bad-id error or the ids' exchange, as :meth:`_ids_dist`."""
        if self._pending_dist is h:
            self._send_pending_counts()
        assert h.message is not None
        read = h.message.result()
        with _stream_of(h.stream):
            return self._send_ids(h.ctx, read)

    def _start_input_dist(self, ctx: HeraldContext, features: KeyedJaggedTensor, B: int) -> "_CountsAwaitable":
        """The per-step input dist's first stage: the split and the counts' exchange started."""
        counts, sizes = self._split_for_dist(ctx, features, B)
        return _CountsAwaitable(self, ctx, *self._exchange_counts(counts), sizes)

    def _exchange_counts(self, counts: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Start the all-to-all of each rank's counts ``[W, 4]`` (one row to each rank): (received, work)."""
        return all_to_all_rows_async(counts, [1] * self._world, [1] * self._world, self._pg, "herald_meta")

    def _split_for_dist(self, ctx: HeraldContext, features: KeyedJaggedTensor, B: int
                        ) -> Tuple[torch.Tensor, "_SplitSizes"]:
        """The input dist's split, no collective: (the counts to exchange ``[W, 4]``, this batch's sizes)."""
        lay = self._ids
        values, lengths = self._ids_of(ctx, features, B)
        W, num_hot = self._world, self._num_hot
        # an id outside its table: a flag travels on the counts exchange below, so every rank learns of it at
        # the first wait (before any forward) and all of them raise it together; until then it reads row 0.
        # Then the hot/cold split, the cold ids and non-empty sub-bags to each (owner, feature) (counted for
        # traffic_by_table, and summed per owner for the exchange) and the hot rows this batch reads (the
        # lookup and its gradient cover only these)
        split, per, read, any_bad, feature_of_value, nonempty_mask = self._split_ids(values, lengths, B)
        self._cold_sent += per
        ids_to, bags_to = per.sum(2)
        # the hot rows read that are synced sparsely are counted on this exchange (none without hot rows)
        if num_hot:
            read_sparse = read & self._sparse_trained[:num_hot]
            read_counts = torch.stack([read, read_sparse]).sum(1)  # hot rows read, of them synced sparsely
            k = read_counts[1:].expand(W, 1)
        else:
            read_sparse, k, read_counts = read, self._no_hot_counts[:W, None], self._no_hot_counts[:2]
        counts = torch.cat([bags_to[:, None], ids_to[:, None], any_bad.to(torch.int64).expand(W, 1), k], 1)
        ctx.split = split
        # both exchanges run asynchronously: TrainPipelineSparseDist starts this input dist before the
        # previous batch's forward and waits for it after. Past the settle above (sparsely synced tables
        # merge their rows with ``torch.unique``; on a CPU the zero-gradient filter), nothing here reads
        # the host: the sizes (sub-bags and ids to each owner, hot rows read, those synced sparsely) are
        # read at the first wait, so on a GPU the host queues the previous batch's forward while these
        # kernels run
        sizes = _SplitSizes(torch.cat([bags_to, ids_to, read_counts]), read, read_sparse,
                            nonempty_mask, values, lengths, B, feature_of_value, per[0].reshape(-1))
        return counts, sizes

    def _split_ids(self, values: torch.Tensor, lengths: torch.Tensor, B: int
                   ) -> Tuple[HotColdSplit, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """The batch's ids split (ids outside their tables read as row 0): (the split, cold ids and non-empty
        sub-bags per (owner, feature) ``[2, W, F]``, the hot rows read ``[num_hot]``, any id outside its
        table (0-d), each id's feature where it was found (the torch ops; None from the compiled pass), each
        sub-bag's non-emptiness)."""
        lay, W, num_hot, F = self._ids, self._world, self._num_hot, len(self._feature_names)
        if self._native_ids is not None:
            sub, hot_offsets, ids, hot_rows, per, read, any_bad = self._native_ids.hot_cold_split(
                values.contiguous(), lengths.contiguous(), lay.feature_table, lay.table_offsets, lay.hot_keys,
                lay.blocks_per_feature, lay.rows_per_feature, W, B)
            return (HotColdSplit(hot_offsets=hot_offsets, bag_lengths=lengths, sub_lengths=sub, bucketed_ids=ids,
                                 bucketed_hot_rows=hot_rows), per, read, any_bad, None, sub > 0)
        feature_of_value, bad = self._features_and_bad(values, lengths, B)
        split = split_hot_cold(values.masked_fill(bad, 0), lengths, lay.feature_table, lay.table_offsets,
                               lay.hot_keys, lay.blocks_per_feature, W, B, feature_of_value=feature_of_value,
                               feature_key_table=lay.feature_key_table)
        sub = split.sub_lengths
        nonempty = sub > 0
        per = torch.stack([sub, nonempty.to(sub.dtype)]).view(2, W, F, B).sum(3)  # one reduction for both
        if num_hot:
            read = torch.zeros(num_hot + 1, dtype=torch.bool, device=lay.device)  # (+ a spare row for cold ids)
            read.index_fill_(0, split.bucketed_hot_rows, True)
        else:  # no hot rows: none read (a step's hot-side kernels are skipped, a GPU's step being its host's)
            read = self._no_rows_read
        return split, per, read[:num_hot], bad.any(), feature_of_value, nonempty

    def _features_and_bad(self, values: torch.Tensor, lengths: torch.Tensor, B: int
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each id's feature and whether it is outside its feature's table (the torch ops, no host read)."""
        feature_of_value = torch.repeat_interleave(self._feature_of_bag(B), lengths, output_size=values.numel())
        return feature_of_value, out_of_table(values, self._ids.rows_per_feature, feature_of_value)

    def _feature_of_bag(self, B: int) -> torch.Tensor:
        """Each bag's feature ``[F*B]`` (bag = feature * B + sample) for batch size ``B``, made once on the ids'
        device: a value's feature is then one ``repeat_interleave`` by the lengths, where an arange, a
        repeat_interleave and a division took three ops (a GPU's step is its host's)."""
        table = self._feature_of_bag_cache.get(B)
        if table is None:
            table = torch.arange(len(self._feature_names), device=self._ids.device).repeat_interleave(B)
            self._feature_of_bag_cache = {B: table, **dict(list(self._feature_of_bag_cache.items())[:3])}  # a few sizes
        return table

    def _sized_by_host(self, ctx: HeraldContext, sizes: "_SplitSizes", host: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """The input dist's data-sized part, at the first wait, from ``host`` (``sizes.sizes`` read): the
        hot rows read (and each hot id's place among them), the non-empty sub-bags and the packed
        ``[lengths to o | rows to o]`` message for each owner ``o``. Returns (message, ids to each owner)."""
        split, W = ctx.split, self._world
        assert split is not None
        ctx.bags_to, ids_to = host[:W], host[W:2 * W]
        if self._native_ids is not None:  # one compiled pass (native/id_split.cpp); the torch ops below: the reference
            ctx.hot_unique, ctx.hot_inverse, ctx.sparse_idx, ctx.send_bag_index, packed = \
                self._native_ids.hot_cold_message(sizes.read, sizes.read_sparse.contiguous(), split.sub_lengths,
                                                  split.bucketed_ids, split.bucketed_hot_rows,
                                                  self._ids.owner_feature_offsets, W, len(self._feature_names),
                                                  ctx.batch_size)
            return packed, ids_to
        FB = len(self._feature_names) * ctx.batch_size
        n_cold, n_read, n_sparse = sum(ids_to), host[2 * W], host[2 * W + 1]
        # sized by the host's figures: no further synchronisation
        if self._num_hot:  # (none read without hot rows: the context's empty defaults)
            ctx.hot_unique = torch.nonzero_static(sizes.read, size=n_read).squeeze(1)
            read_rank = torch.cumsum(sizes.read, 0) - 1  # each read row's position among hot_unique
            ctx.hot_inverse = read_rank[split.bucketed_hot_rows[n_cold:]]
            ctx.sparse_idx = read_rank[torch.nonzero_static(sizes.read_sparse, size=n_sparse).squeeze(1)]
        nonempty = torch.nonzero_static(sizes.nonempty, size=sum(ctx.bags_to)).squeeze(1)
        lay, sub = self._ids, split.sub_lengths
        cold_ids = split.bucketed_ids[:n_cold]
        # each cold id's row in its owner's block: its sub-bag's (owner, feature) offset plus its local id
        cold_rows = torch.repeat_interleave(lay.owner_feature_offsets, sizes.ids_per_owner_feature,
                                            output_size=n_cold) + cold_ids
        ctx.send_bag_index = nonempty % FB
        lengths_to = sub[nonempty].to(torch.int32).split(ctx.bags_to)
        rows_to = cold_rows.to(torch.int32).split(ids_to)
        return torch.cat([t for o in range(W) for t in (lengths_to[o], rows_to[o])]), ids_to

    def _ids_dist(self, ctx: HeraldContext, recv_counts: torch.Tensor, sizes: "_SplitSizes") -> "_IdsAwaitable":
        """The counts arrived: raise on any rank's bad id (every rank together), then read this batch's
        sizes, build the message and start the all-to-all of the sub-bag lengths and ids."""
        return self._send_ids(ctx, self._message_for_dist(ctx, recv_counts, None, sizes))

    def _message_for_dist(self, ctx: HeraldContext, recv_counts: torch.Tensor, work: Any, sizes: "_SplitSizes"
                          ) -> "_Message":
        """The counts' exchange waited for (``work``, if given), the input dist's one host read (the counts
        received and this rank's own sizes) and, unless some rank has a bad id, the message to send. No
        collective: a handed-off input dist runs this on its worker thread."""
        if work is not None:
            work.wait()
        W = self._world
        host = torch.cat([recv_counts.flatten().to(torch.int64), sizes.sizes]).tolist()
        got = [host[4 * r: 4 * r + 4] for r in range(W)]  # per rank: sub-bags, ids, any bad id, k
        bad_ranks = [r for r, g in enumerate(got) if g[2]]
        if bad_ranks:
            return _Message(sizes, bad_ranks)
        packed, ids_to = self._sized_by_host(ctx, sizes, host[4 * W:])
        ctx.bags_from, ids_from, ctx.sparse_from = [g[0] for g in got], [g[1] for g in got], [g[3] for g in got]
        return _Message(sizes, [], packed, [b + i for b, i in zip(ctx.bags_to, ids_to)],
                        [n for b, i in zip(ctx.bags_from, ids_from) for n in (b, i)])

    def _send_ids(self, ctx: HeraldContext, m: "_Message") -> "_IdsAwaitable":
        """Raise a bad id on every rank together (a collective finds each rank's first), or start the
        all-to-all of the sub-bag lengths and ids."""
        if m.bad_ranks:
            self._raise_on_bad_ids(m.bad_ranks, m.sizes.values, m.sizes.features())
        assert m.packed is not None
        recv_sizes = m.recv_sizes
        recv, work = all_to_all_rows_async(m.packed, m.send, [recv_sizes[2 * r] + recv_sizes[2 * r + 1]
                                                               for r in range(self._world)], self._pg, "herald_ids")
        return _IdsAwaitable(ctx, recv, work, recv_sizes)

    def traffic_by_table(self) -> Dict[str, Dict[str, float]]:
        """Bytes this rank sent per table since construction/reset: ids (+ lengths) to remote owners,
        pooled vectors it received from them (counted at the requester: the same bytes, summed over
        ranks) and their gradients, hot_sync."""
        remote = torch.arange(self._world) != self._rank
        ids, bags = self._cold_sent.cpu()[:, remote].sum(1).double()  # [F] each
        traffic = self._traffic.clone()
        sent = torch.zeros(len(self._tables), dtype=torch.float64).index_add_(
            0, self.layout.hot_slot_table, self._hot_sparse_sent[:self._num_hot].cpu().double())
        traffic[:, 3] += sent * (
            (self._world - 1) * (INDEX_BYTES + FLOAT_BYTES * self._dim))
        ft = self.layout.feature_table
        traffic[:, 0].index_add_(0, ft, INDEX_BYTES * (ids + bags))
        traffic[:, 1].index_add_(0, ft, FLOAT_BYTES * self._dim * bags)
        traffic[:, 2].index_add_(0, ft, FLOAT_BYTES * self._dim * bags)
        return {t: dict(zip(("ids", "pooled", "grads", "hot_sync"), traffic[i].tolist()))
                for i, t in enumerate(self._tables)}

    def _raise_on_bad_ids(self, bad_ranks: List[int], values: torch.Tensor, features: torch.Tensor) -> None:
        """Some ranks flagged an id outside its table (``bad_ranks``, known to every rank): each rank finds its
        own first one among ``values`` (each of feature ``features``; a host read: this error path only), all
        of them exchange theirs (collective), and every rank raises the first bad id of rank
        ``bad_ranks[0]``'s batch."""
        code = invalid_ids(values, self._ids.rows_per_feature, features)[1]
        codes = [code]
        if self._world > 1:
            codes = [torch.empty_like(code) for _ in range(self._world)]
            dist.all_gather(codes, code, group=self._pg)
        feature_plus_one, value = codes[bad_ranks[0]].tolist()
        raise self.bad_id_error(bad_ranks, feature_plus_one - 1, value)

    def no_weights(self) -> str:
        """Why a KJT with per-sample weights cannot reach this EBC, naming its herald tables and features, and the
        two ways out (a weighted EBC's KJT reaching an unweighted EBC is the usual cause)."""
        def some(names: List[str]) -> str:
            return ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")

        return (f"herald's tables {some(self._tables)} (features {some(self._feature_names)}) read it, and herald's "
                f"sharding has no per-sample weights (TorchRec's sharded EBC applies a KJT's weights even where "
                f"is_weighted=False): give their EBC a KJT without weights (a weighted EBC a KJT of its own), or keep "
                f"these tables stock (ParameterConstraints without row_wise)")

    def bad_id_error(self, bad_ranks: List[int], feature: int, value: int) -> ValueError:
        """The error every rank raises for an id outside its table: ``value`` of feature index ``feature``
        in the batch of ``bad_ranks[0]`` (all ranks whose batches held one: ``bad_ranks``)."""
        t = int(self.layout.feature_table[feature])
        return ValueError(f"id {value} of feature '{self._feature_names[feature]}' is outside table "
                          f"'{self._tables[t]}' [0, {self._num_embeddings[t]}) (in rank {bad_ranks[0]}'s batch; "
                          f"ranks with bad ids: {bad_ranks})")

    def compute(self, ctx: HeraldContext, dist_input: Any) -> Tuple[torch.Tensor, Optional[RowsInFlight], torch.Tensor]:
        """Owner side: partial pooled vectors of the received sub-bags, their return to the samples' ranks
        started (async); local side: hot pooled vectors, looked up while the partial vectors travel."""
        if isinstance(dist_input, KJTList):  # the awaitables above deliver a one-element KJTList
            dist_input = dist_input[0]
        if dist_input.ws_index is not None:  # plan mode: every row is local, in the working set
            return (torch.empty(0, self._dim, device=self._device), None,
                    dense_lookup(self.plan_executor.ws, dist_input.ws_index, dist_input.ws_offsets))
        dev = self._device
        if dist_input.split is None:  # one rank, no hot rows: every bag pooled here, in the output's order
            return (torch.empty(0, self._dim, device=dev), None, self._store.cold(
                dist_input.recv_rows, torch.ops.fbgemm.asynchronous_complete_cumsum(dist_input.recv_lengths)))
        # cold rows are never hot: their lookup need not wait for the hot rows' pending update. The rows and
        # sub-bag lengths arrive as int32 (the wire's index type), which fbgemm's TBE takes as they are where
        # indices and offsets share it: no cast of either (a launch each on a GPU)
        partial = self._store.cold(dist_input.recv_rows.to(dev),
                                   torch.ops.fbgemm.asynchronous_complete_cumsum(dist_input.recv_lengths.to(dev)))
        flight = start_variable_all_to_all(partial, dist_input.bags_from, dist_input.bags_to, self._pg,
                                           ("herald_pooled", "herald_pooled_grad"), self._dim)
        split = dist_input.split
        assert split is not None
        if not self._num_hot:  # no hot rows: the partial vectors are added to zeros (no lookup, no hook)
            return partial, flight, torch.zeros(split.hot_offsets.numel() - 1, self._dim, device=dev)
        # the hot rows this batch reads, as a leaf of their own: backward gives their gradient only
        # (``[rows read, D]``, not the whole hot buffer's), which the hook starts summing over ranks
        rows = self.store.hot_weights()[dist_input.hot_unique.to(dev)].requires_grad_()
        rows.register_post_accumulate_grad_hook(functools.partial(
            self._sync_and_update_hot, dist_input.hot_unique, dist_input.sparse_idx, dist_input.sparse_from))
        hot = dense_lookup(rows, dist_input.hot_inverse, split.hot_offsets)
        return partial, flight, hot

    def output_dist(self, ctx: HeraldContext, output: Tuple[torch.Tensor, Optional[RowsInFlight], torch.Tensor]
                    ) -> LazyAwaitable[KeyedTensor]:
        """Receive the partial pooled vectors of this rank's samples and add them to the hot part (a next
        input dist handed to the worker sends its counts first: a fixed point of the training thread)."""
        self._send_pending_counts()
        partial, flight, hot = output
        if flight is None:  # plan mode, or one rank without hot rows: nothing to return to other ranks
            pooled = hot
        else:
            back = await_variable_all_to_all(partial, flight)
            # into the hot part (in place where it is compute's fresh zeros: nothing reads them but this)
            add = hot.index_add if hot.requires_grad else hot.index_add_
            pooled = add(0, ctx.send_bag_index.to(hot.device), back)
        if get_gradient_division() and self._world > 1:  # (at one rank the division is by 1: no op)
            # stock TorchRec divides pooled-embedding gradients by the world size in its output
            # all-to-all's backward (matching DDP's averaging of dense grads): do the same
            pooled = _ScaleGrad.apply(pooled, 1.0 / self._world)
        B, F = ctx.batch_size, len(self._feature_names)
        if self._any_mean:
            mean_bag = self._mean_features.repeat_interleave(B)
            scale = torch.where(mean_bag, 1.0 / ctx.bag_lengths.clamp(min=1).to(pooled.device, pooled.dtype),
                                torch.ones((), dtype=pooled.dtype, device=pooled.device))
            pooled = pooled * scale[:, None]
        values = pooled.view(F, B, self._dim).transpose(0, 1).reshape(B, F * self._dim)
        return LazyNoWait(KeyedTensor(keys=self._feature_names, length_per_key=[self._dim] * F, values=values))

    # ------------------------------------------------------------------ plan mode (Herald scheduling)
    def in_feature_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with its keys in this module's feature order (error naming the missing features)."""
        if kjt.keys() == self._feature_names:
            return kjt
        missing = [f for f in self._feature_names if f not in kjt.keys()]
        if missing:
            raise ValueError(f"features {missing} of the herald EBC are missing from the input KJT")
        return kjt.permute([kjt.keys().index(f) for f in self._feature_names])

    def batch_feature_order(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with this module's features first, in its order, then any others by name (the stock
        tables' features of a mixed EBC, which the pipeline carries along with each sample: every rank's
        batch then lists them alike, whatever order each loader gave them in, as a sample's move needs)."""
        keys, F = kjt.keys(), len(self._feature_names)
        if keys[:F] == self._feature_names and keys[F:] == sorted(keys[F:]):
            return kjt
        mine = set(self._feature_names)
        missing = [f for f in self._feature_names if f not in keys]
        if missing:
            raise ValueError(f"features {missing} of the herald EBC are missing from the input KJT")
        others = sorted((k, i) for i, k in enumerate(keys) if k not in mine)
        return kjt.permute([keys.index(f) for f in self._feature_names] + [i for _, i in others])

    def global_keys(self, values: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """Global row key of every id of a KJT in this module's feature order (see ``RowLayout.feature_keys``)."""
        return self.layout.feature_keys(values, lengths, batch_size)

    @property
    def plan_executor(self) -> PlanExecutor:
        """This rank's :class:`~torchrec_herald.sharding.plan_exec.PlanExecutor` (plan mode; built on first use).
        Like :attr:`store`, it settles a hot-row update still in flight first: the executor reads the rows."""
        store = self.store
        if self._executor is None:
            self._executor = PlanExecutor(store, self._pg)
        return self._executor

    def begin_plan_step(self, plan: Any) -> None:
        """Plan mode for the next forward: run the plan's pre-read transfers (collective); the forward
        then looks every id up locally, in the plan's working set."""
        self.plan_executor.begin(plan)

    def _plan_input_dist(self, ctx: HeraldContext, values: torch.Tensor, lengths: torch.Tensor, B: int
                         ) -> Awaitable[Awaitable[HeraldContext]]:
        ctx.ws_index = self.plan_executor.working_set(
            self.layout.feature_keys(values, lengths, B, self._ids.feature_offsets))
        ctx.ws_offsets = offsets_from_lengths(lengths)
        return KJTListSplitsAwaitable([NoWait(NoWait(ctx))], ctx)

    def prefetch_plan(self, plan: Any) -> None:
        """Start the next step's pulls now (async; see :meth:`PlanExecutor.prefetch`)."""
        self.plan_executor.prefetch(plan)

    def drain_plan(self, plan: Any) -> None:
        """Execute a plan whose batch will not be trained (no-op on every value; collective)."""
        self.plan_executor.run_without_gradients(plan)

    def finish_plan_step(self, next_plan: Any = None) -> None:
        """After backward: reduce, exact update, pushes and evictions of the plan (collective);
        ``next_plan``: the next step's plan where it is made already (see :meth:`PlanExecutor.finish`)."""
        self.plan_executor.finish(next_plan)

    def set_frozen_keys(self, keys: torch.Tensor) -> None:
        """Plan mode, stale-update skipping (``row``): global keys of hot rows read without an update."""
        self.plan_executor.frozen_keys = keys.to(torch.int64)

    def flush_plan(self, flush: Any) -> None:
        """Back to the stock herald layout (see :meth:`PlanExecutor.flush`; collective)."""
        self.plan_executor.flush(flush)

    def set_frozen_hot(self, frozen: Optional[torch.Tensor]) -> None:
        """Stale-update skipping, ``row`` granularity, on this module's own per-step path: hot rows with
        ``frozen[i]`` (bool ``[num_hot]``, the same on every rank) are neither synchronised nor updated
        (their gradients are dropped); ``None`` trains every row again."""
        frozen_hot = torch.zeros(max(self._num_hot, 1), dtype=torch.bool)
        if frozen is not None and self._num_hot:
            frozen_hot[: self._num_hot] = frozen.cpu()
        self._frozen_hot = frozen_hot.to(self._device)  # (where the ids are handled)
        # per hot row: synced sparsely and not frozen (the rows whose reads ride on the counts exchange)
        self._sparse_trained = self._ids.sparse_row & ~self._frozen_hot[: self._ids.sparse_row.numel()]
        # their slots, found on the host (the sum on a GPU's path updates all of them, :meth:`settle_hot_sync`)
        n = self._sparse_row.numel()
        self._sparse_rows = (self._sparse_row & ~frozen_hot[:n]).nonzero().flatten().to(self._device)
        self._set_dense_rows(self._all_dense_rows[~frozen_hot[self._all_dense_rows]])

    def hot_values(self) -> torch.Tensor:
        """The hot replica rows ``[num_hot, D]`` (a copy, on CPU: the scheduler's side)."""
        return self.store.hot_weights()[: self._num_hot].to("cpu", copy=True)

    # ------------------------------------------------------------------ hot replicas: sync + exact update
    def _set_dense_rows(self, rows: torch.Tensor) -> None:
        """The hot rows synced densely (all-reduced), and each hot row's slot in the sum's scratch: its
        position among them, or the spare slot past them."""
        pos = torch.full((max(self._num_hot, 1),), -1, dtype=torch.int64)
        pos[rows] = torch.arange(rows.numel())
        self._dense_rows = rows.to(self._device)  # where the ids are handled
        # each hot row's slot in the dense sum's scratch: its position there, or the spare last slot
        self._dense_slot = torch.where(pos >= 0, pos, rows.numel()).to(self._device)
        # bytes this rank sends per table and step for them (ring all-reduce), as TrafficMeter counts
        per_table = torch.bincount(self.layout.hot_slot_table[rows], minlength=len(self._tables)).double()
        self._dense_sync_bytes = per_table * ring_allreduce_bytes(FLOAT_BYTES * self._dim, self._world)

    def _sync_and_update_hot(self, unique: torch.Tensor, sparse_idx: torch.Tensor, sparse_from: List[int],
                             rows: torch.Tensor) -> None:
        """Backward hook of the hot rows a batch read (``unique``; ``rows`` their leaf): start summing
        their gradients over ranks (async), so the exchange overlaps the rest of the step and the start of
        the next; :meth:`settle_hot_sync` (at the next use of the rows or of the optimizer state) waits and
        applies the fused kernel's update rule (EXACT_SGD or EXACT_ROWWISE_ADAGRAD) identically on every
        replica. Densely synced tables all-reduce all their hot rows (zeros where this rank read none);
        sparsely synced ones exchange the rows each rank read. Nothing here is sized by the data (no
        boolean masks, no ``bincount``): the sparse rows' positions came from the input dist, so on a GPU
        backward never waits for the host."""
        grad = rows.grad
        rows.grad = None
        if grad is None or self._num_hot == 0:
            return
        self.settle_hot_sync()
        W, row_bytes = self._world, FLOAT_BYTES * self._dim
        dev = grad.device
        pending = _PendingHotSync()
        with traffic_tag("herald_hot_sync", self._dim):
            if self._dense_rows.numel():  # tables synced densely: one ring all-reduce of their rows
                n = self._dense_rows.numel()
                # rows read but not synced densely land in a spare last row, dropped before the sum
                scratch = torch.zeros(n + 1, self._dim, device=dev)
                scratch.index_copy_(0, self._dense_slot[unique].to(dev), grad)
                dense = scratch[:n]
                pending.dense = (self._dense_rows, dense, all_reduce_async(dense, self._pg, "herald_hot_sync", self._dim))
            if self._any_sparse:  # tables synced sparsely: exchange touched rows only
                touched = unique.index_select(0, sparse_idx)
                pending.sparse = self._start_sparse_sum(touched, grad.index_select(0, sparse_idx), sparse_from)
                # counted where the rows are (no host read in backward); traffic_by_table turns it into bytes
                self._hot_sparse_sent.index_add_(0, touched, self._one.expand(touched.numel()))
        self._traffic[:, 3] += self._dense_sync_bytes
        self._pending_hot = pending

    def settle_hot_sync(self) -> None:
        """Finish the hot-row gradient sum started in backward and apply the update (no-op if none is
        in flight). Every use of the rows (:attr:`store`) calls it first, so no read sees a stale replica."""
        p = self._pending_hot
        if p is None:
            return
        self._pending_hot = None
        rows: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        if p.dense is not None:
            dense_rows, dense, work = p.dense
            work.wait()
            _used_on_this_stream(dense_rows, dense)
            rows.append(dense_rows)
            grads.append(dense)
        if p.sparse is not None:
            got, work = p.sparse
            work.wait()
            _used_on_this_stream(got)
            ids = got[:, 0].view(torch.int32).to(torch.int64)  # (a strided dtype view: no copy before the cast)
            if self._native_ids is None:
                # the path of ids on a GPU: every sparsely synced row gets its sum (zero where no rank read it,
                # which leaves it as it was: RowStore.update_hot_rows), so nothing is sized by the data and the
                # host never waits here (torch.unique would). The rows arrive in rank order and are added in one
                # op whatever W is, deterministically: every replica sums alike, bit for bit, on a GPU too
                summed = add_rows_in_order(torch.zeros(max(self._num_hot, 1), self._dim, device=got.device),
                                           ids, got[:, 1:])
                rows.append(self._sparse_rows)
                grads.append(summed.index_select(0, self._sparse_rows))
            else:
                # every rank adds each row's gradients up in rank order (index_add_ follows the source order on
                # a CPU): bit-identical sums on every replica
                unique, slot = torch.unique(ids, return_inverse=True)
                rows.append(unique)
                grads.append(torch.zeros(unique.numel(), self._dim, device=got.device).index_add_(0, slot, got[:, 1:]))
        if rows:  # (one part, as with one sync mode: no copy)
            self._store.update_hot_rows(*((rows[0], grads[0]) if len(rows) == 1 else (torch.cat(rows), torch.cat(grads))))
        if self._lr_after_settle is not None:  # (a learning rate set while this update was in flight)
            self._store.lr, self._lr_after_settle = self._lr_after_settle, None

    def set_learning_rate(self, lr: float) -> None:
        """The embedding learning rate from now on: the cold rows' fused update from the next backward, herald's
        own updates too, except the hot-row update in flight, computed under the old rate, which applies it at
        its settle (not waited for here: it keeps overlapping the next step's start)."""
        self._store.set_learning_rate(lr, own_updates=self._pending_hot is None)
        self._lr_after_settle = None if self._pending_hot is None else float(lr)

    def reset_parameters(self) -> None:
        """Initialise every row this rank holds exactly as stock TorchRec's ROW_WISE sharding of the same
        meta-built EBC does (collective: the hot replicas are then filled from their owners' blocks).

        Stock builds one fused TBE over each rank's row blocks, whose constructor draws every block
        uniform in the table's ``weight_init_min/max``, then ``ShardedEmbeddingBagCollection.
        reset_parameters`` calls each table's ``init_fn`` (config order) on the table's ShardedTensor,
        i.e. on the rank's block. Herald's cold blocks have the same row ranges, so doing the same two
        passes draws the same numbers from this rank's generator: for the same seed a herald model
        starts from the weights stock ROW_WISE would (TABLE_WISE draws each whole table on its owner's
        generator instead, so its weights depend on which rank owns which table)."""
        store = self._store
        with torch.no_grad():
            for t, cfg in enumerate(self._configs):  # the fused TBE's own initialisation (stock draws it too)
                store.cold_block(t).uniform_(cfg.get_weight_init_min(), cfg.get_weight_init_max())
            for t, cfg in enumerate(self._configs):
                if cfg.init_fn is not None:
                    cfg.init_fn(self.sharded_block(t, store.cold_block(t)))
        self.refresh_hot_from_blocks()

    def refresh_hot_from_blocks(self) -> None:
        """After the cold blocks were loaded (weights/optimizer state), give every replica the owners'
        values of the hot rows (collective: each owner contributes its rows, the others zeros)."""
        store = self.store
        with torch.no_grad():
            hot_w = torch.zeros(max(self._num_hot, 1), self._dim, device=self._device)
            hot_w[store.mirror_hot] = store.cold_weights()[store.mirror_cold]
            momentum = store.cold_state()
            hot_s = torch.zeros_like(store.hot_state)
            if momentum is not None:
                hot_s[store.mirror_hot] = momentum[store.mirror_cold]
            both = torch.cat([hot_w.view(-1), hot_s])
            dist.all_reduce(both, group=self._pg)
            n = hot_w.numel()
            store.hot_weights().view(-1)[:n].copy_(both[:n])
            store.hot_state.copy_(both[n:])

    def sharded_block(self, t: int, local: torch.Tensor) -> Any:
        """``local`` (this rank's block of table t: ``[rows, dim]`` or ``[rows]``) as a ShardedTensor with
        stock ROW_WISE's metadata, so TorchRec's state loading copies shard for shard."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
        from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

        trailing = list(local.shape[1:])
        metas = [ShardMetadata(shard_offsets=[self.layout.block_range(t, o)[0]] + [0] * len(trailing),
                               shard_sizes=[self.layout.block_range(t, o)[1]] + trailing,
                               placement=f"rank:{o}/{self._device}") for o in range(self._world)]
        mine = [Shard(local, metas[self._rank])]
        global_meta = ShardedTensorMetadata(
            shards_metadata=metas, size=torch.Size([self._num_embeddings[t]] + trailing),
            tensor_properties=TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                               memory_format=torch.contiguous_format, pin_memory=False))
        return ShardedTensor._init_from_local_shards_and_global_metadata(mine, global_meta, process_group=self._pg)

    def _start_sparse_sum(self, rows: torch.Tensor, grad: torch.Tensor, counts_from: List[int]) -> Tuple[torch.Tensor, Any]:
        """Start the exchange of the gradients ``grad`` of the hot ``rows`` each rank touched: every rank
        sends its touched rows to every other rank in one all-to-all of ``[row id (int32 bits) | D floats]``
        (the counts came with the input dist's exchange). Returns (the rows received, the work)."""
        W, k = self._world, rows.numel()
        rows = rows.to(grad.device)
        payload = torch.cat([rows.to(torch.int32).view(-1, 1).view(torch.float32), grad], 1)
        return all_to_all_rows_async(payload.repeat(W, 1), [k] * W, counts_from, self._pg, "herald_hot_sync",
                                     self._dim + 1)

    # ------------------------------------------------------------------ state
    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def _load_full(self, tables: Dict[str, torch.Tensor]) -> None:
        """Copy full ``[n, dim]`` tables into this rank's cold blocks and hot replicas (tables absent
        from ``tables`` are left as they are)."""
        with torch.no_grad():
            for t, name in enumerate(self._tables):
                if name not in tables:
                    continue
                full = tables[name]
                if tuple(full.shape) != (self._num_embeddings[t], self._dim):
                    raise ValueError(f"table {name}: expected shape {(self._num_embeddings[t], self._dim)}, "
                                     f"got {tuple(full.shape)}")
                start, rows = self.layout.block_range(t, self._rank)
                self.store.cold_block(t).copy_(full[start: start + rows])
                self.store.hot_block(t).copy_(full[self.layout.hot_ids[t].to(full.device)])
            self.store.mirror_hot_into_cold()

    def _check_flushed(self, what: str) -> None:
        """Herald scheduling's caches may hold rows newer than the tables between two steps: ``what`` would read
        the tables (home blocks and hot replicas) stale, so it is refused, naming the flush that makes them
        current."""
        if self._executor is not None and self._executor.unflushed:
            raise RuntimeError(f"herald EBC: {what} between two steps of Herald scheduling, whose caches hold rows "
                               f"newer than the tables: call HeraldTrainPipeline.flush() first (collective; training "
                               f"then goes on as before), or evaluate through pipeline.progress() with model.eval(), "
                               f"which flushes itself")

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:  # type: ignore[override]
        """``{prefix}embedding_bags.<table>.weight`` → a ShardedTensor in stock ROW_WISE's layout whose
        local shard is this rank's block (a view: ``torch.distributed.checkpoint`` loads into it in place;
        call :meth:`refresh_hot_from_blocks` after such a load). The blocks hold every row's current
        value, hot rows included; in plan mode flush first (``HeraldTrainPipeline.flush``)."""
        self._check_flushed("state_dict()")
        destination = {} if destination is None else destination
        for t, name in enumerate(self._tables):
            destination[f"{prefix}embedding_bags.{name}.weight"] = self.sharded_block(t, self.store.cold_block(t))
        return destination

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:  # type: ignore[override]
        """Accepts this layout's ShardedTensors (each rank copies its own block: no table is gathered),
        full ``[n, dim]`` tensors (an unsharded model's), or ShardedTensors of another layout (stock
        TABLE_WISE: gathered table by table, collective; ``torchrec_herald.checkpoint`` reshards those with
        ``torch.distributed.checkpoint`` instead). Hot replicas are refreshed from the loaded rows."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        keys = {f"embedding_bags.{n}.weight" for n in self._tables}
        unexpected = sorted(set(state_dict) - keys)
        missing = sorted(keys - set(state_dict))
        if strict and (missing or unexpected):
            raise RuntimeError(f"herald EBC load_state_dict: missing {missing}, unexpected {unexpected}")
        tables = {}
        local_blocks: Dict[int, torch.Tensor] = {}
        for t, name in enumerate(self._tables):
            v = state_dict.get(f"embedding_bags.{name}.weight")
            if v is None:
                continue
            shape = (self._num_embeddings[t], self._dim)
            if tuple(v.shape) != shape:
                raise ValueError(f"table {name}: the checkpoint holds shape {tuple(v.shape)}, the model {shape}")
            if isinstance(v, ShardedTensor) and self._same_blocks(t, v):
                local_blocks[t] = v.local_shards()[0].tensor if v.local_shards() else torch.empty(0, self._dim)
                continue
            if isinstance(v, ShardedTensor):
                full = torch.zeros(shape, device=self._device) if self._rank == 0 else None
                v.gather(dst=0, out=full)
                full = full if full is not None else torch.empty(shape, device=self._device)
                dist.broadcast(full, src=0, group=self._pg)
                v = full
            tables[name] = v.detach().to(torch.float32)
        if tables:
            self._load_full(tables)  # strict=False: the tables present are loaded, as nn.Module does
        if local_blocks:  # each rank its own block, then every replica from the blocks' owners
            with torch.no_grad():
                for t, block in local_blocks.items():
                    self.store.cold_block(t).copy_(block)
            self.refresh_hot_from_blocks()
        from torch.nn.modules.module import _IncompatibleKeys

        return _IncompatibleKeys(missing, unexpected)

    def _same_blocks(self, t: int, v: Any) -> bool:
        """``v`` (a ShardedTensor of table t) is laid out as this module's blocks, rank for rank."""
        metas = v.metadata().shards_metadata
        if len(metas) != self._world:
            return False
        for o in range(self._world):
            start, rows = self.layout.block_range(t, o)
            m = [x for x in metas if x.placement is not None and x.placement.rank() == o]
            if len(m) != 1 or list(m[0].shard_offsets[:1]) != [start] or list(m[0].shard_sizes[:1]) != [rows]:
                return False
        return True

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection
