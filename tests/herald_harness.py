"""Shared harness: train stock TorchRec and herald on the same global batches, return losses and weights."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

FEATURE_SCALE = 0.001  # Criteo cardinalities x 0.001: 26 tables, ~34k rows -> fast on 2 cores

#: Exactness tolerances, relative. Per-step losses: LOSS_RTOL. Final weights (max|h - s| / max|s| per
#: tensor): :func:`weight_rtol`.
LOSS_RTOL = 1e-5


def messages_of(logger_name: str) -> List[str]:
    """The messages ``logger_name`` (and its children) logs from now on, in order (in a rank's process)."""
    seen: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger_name).addHandler(handler)
    return seen


def weight_rtol(optimizer: str) -> float:
    """Final-weight tolerance of herald vs stock: 1e-5 with SGD; 1e-4 with row-wise Adagrad, whose
    lr / sqrt(state) step amplifies summation-order rounding (herald adds per-rank partial sums of a hot
    row's gradient, TorchRec's kernel adds every occurrence in turn). After 50 steps at 2 ranks the dense
    weights then differ by up to 3.3e-5 on an AVX-512 Xeon (under 1e-5 on the host these tests were first
    run on), and stock's own ROW_WISE and TABLE_WISE differ by up to 1e-4 with multi-id bags; the losses
    stay within LOSS_RTOL."""
    return 1e-4 if optimizer == "rowwise_adagrad" else 1e-5


def full_state(dmp: Any) -> Dict[str, torch.Tensor]:
    """DMP state dict with every ShardedTensor gathered into a full tensor (collective)."""
    return gather_state(dmp.state_dict())


def gather_state(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """``state`` with every ShardedTensor gathered into a full tensor on every rank (collective)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size()) if dist.get_rank() == 0 else None
            v.gather(dst=0, out=full)
            full = full if full is not None else torch.zeros(v.size())
            dist.broadcast(full, 0)
            v = full
        out[k] = v.detach().to("cpu", copy=True)
    return out


def table_rows(state: Dict[str, torch.Tensor], table: str) -> torch.Tensor:
    """Table ``table``'s full weight in a :func:`gather_state` state (its ``embedding_bags.<table>.weight`` key)."""
    return state[next(k for k in state if k.endswith(f"embedding_bags.{table}.weight"))]


def hot_replica_gap(ebc: Any, state: Dict[str, torch.Tensor]) -> float:
    """Largest |hot replica − the model's row| on this rank, 0.0 where every hot replica holds the row the model's
    table holds (``state``: :func:`gather_state`'s, the owners' rows). Gathered tables are alike on every rank by
    construction; this is what tells whether a rank's own replicas agree with them."""
    lay = ebc.layout
    expected = torch.cat([table_rows(state, t)[ids] for t, ids in zip(lay.tables, lay.hot_ids)])
    got = ebc.hot_values()
    assert got.shape == expected.shape and got.numel() > 0, (tuple(got.shape), tuple(expected.shape))
    return float((got - expected).abs().max())


def full_momentum(dmp: Any) -> Dict[str, torch.Tensor]:
    """Every table's row-wise Adagrad state (``<table>.momentum1``) as a full tensor on every rank, whatever the layout
    (stock TABLE_WISE keeps a table's state on its one rank only): each rank fills in its local shards, then one
    all-reduce (collective)."""
    st = dmp.fused_optimizer.state_dict()["state"]
    local = {k: v for per in st.values() for k, v in per.items() if k.endswith("momentum1")}
    sizes: list = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, {k: list(v.size()) for k, v in local.items()})
    merged = {k: s for d in sizes for k, s in d.items()}
    out = {}
    for k in sorted(merged):
        full = torch.zeros(merged[k])
        for shard in (local[k].local_shards() if k in local else []):
            off = shard.metadata.shard_offsets[0]
            full[off: off + shard.tensor.shape[0]] = shard.tensor
        dist.all_reduce(full)
        out[k] = full
    return out


def multi_hot(kjt: Any) -> Any:
    """Deterministic multi-id bags from a one-id KJT: sample i of feature f gets ``(i + f) % 4`` ids
    (0 to 3: empty bags included), those of samples i, i+1, ... of the same feature (ids repeat in a
    bag when they are hot). Makes MEAN pooling and bags split over hot rows and several owners real."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    B = kjt.stride()
    values, lengths = [], []
    for f, key in enumerate(kjt.keys()):
        ids = kjt[key].values()
        n = torch.tensor([(i + f) % 4 for i in range(B)], dtype=torch.int64)
        start = torch.repeat_interleave(torch.arange(B), n)
        step = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        values.append(ids[(start + step) % B])
        lengths.append(n)
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=torch.cat(lengths).to(torch.int32))


class MappedData:
    """``data`` whose train batches pass through ``fn(step, rank, world, batch_size, batch) -> batch``
    (everything else is ``data``'s)."""

    def __init__(self, data: Any, fn: Any) -> None:
        self._data, self._fn = data, fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)

    def train_batches(self, rank: int, world: int, batch_size: int) -> Iterator[Any]:
        for step, b in enumerate(self._data.train_batches(rank, world, batch_size)):
            yield self._fn(step, rank, world, batch_size, b)

    def train_batches_from(self, rank: int, world: int, batch_size: int, start: int) -> Iterator[Any]:
        return itertools.islice(self.train_batches(rank, world, batch_size), start, None)  # mapped too


def MultiHotData(data: Any) -> MappedData:  # noqa: N802 - reads as the data source it builds
    """A data source whose train batches' KJTs are :func:`multi_hot` versions of ``data``'s."""
    from torchrec.datasets.utils import Batch

    return MappedData(data, lambda step, rank, world, bs, b: Batch(
        dense_features=b.dense_features, sparse_features=multi_hot(b.sparse_features), labels=b.labels))


def error_of(fn: Any) -> str:
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is asserted
        return f"{type(e).__name__}: {e}"
    return "no error"


@contextlib.contextmanager
def exact_row_wise_mean() -> Iterator[None]:
    """Stock ROW_WISE computes MEAN pooling as ``sum / (bag_length + 1e-6)`` (TorchRec's
    ``_create_mean_pooling_divisor`` adds a 1e-6 guard against empty bags), so it differs from the
    unsharded EBC, stock TABLE_WISE and herald (``sum / max(bag_length, 1)``) in the 6th digit,
    which row-wise Adagrad amplifies. Inside this block the divisor is the exact bag length
    (1 for empty bags): the exact-mean ROW_WISE reference."""
    import torchrec.distributed.embeddingbag as ebc_mod

    orig = ebc_mod._create_mean_pooling_divisor

    def exact(*args: Any, **kwargs: Any) -> torch.Tensor:
        return orig(*args, **kwargs).round().clamp(min=1.0)

    ebc_mod._create_mean_pooling_divisor = exact
    try:
        yield
    finally:
        ebc_mod._create_mean_pooling_divisor = orig


def hot_specs_from_data(data: Any, tables: List[Any], min_count: int, sync: str, batches: int = 5,
                        global_batch: int = 64) -> Dict[str, Any]:
    """Deterministic hot sets for tests: ids seen >= min_count times in the first global batches.
    ``sync="mixed"``: even-indexed tables dense, odd-indexed ones sparse (both modes in one module)."""
    from torchrec_herald.sharding.types import HotSpec

    counts = [torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables]
    for i, batch in enumerate(data.train_batches(0, 1, global_batch)):
        if i == batches:
            break
        kjt = batch.sparse_features
        for f, jt in enumerate(kjt.split([1] * len(tables))):
            counts[f] += torch.bincount(jt.values(), minlength=tables[f].num_embeddings)
    modes = [(("dense", "sparse")[i % 2] if sync == "mixed" else sync) for i in range(len(tables))]
    return {t.name: HotSpec((c >= min_count).nonzero().flatten(), sync=m) for t, c, m in zip(tables, counts, modes)}


def make_data(cfg: Dict[str, Any]) -> Any:
    from torchrec_herald.data import SyntheticCriteo

    data = SyntheticCriteo(scale=FEATURE_SCALE, num_train_batches=cfg.get("steps", 10), seed=1)
    return MultiHotData(data) if cfg.get("multi_hot", False) else data


def build(world: int, cfg: Dict[str, Any], data: Optional[Any] = None) -> Dict[str, Any]:
    """Seeded DLRM (every rank the same weights) -> plan of ``cfg["planner"]`` -> DMP + CombinedOptimizer.

    cfg: planner (table_wise|row_wise|herald), optimizer (sgd|rowwise_adagrad), via (apply|fused_params),
    dense_sync (ddp|forward_ordered|forward_ordered_in_backward: TorchRec's DDP or
    :class:`ForwardOrderedDenseSync`, its sums started at the step or inside backward),
    pooling (SUM|MEAN), batch_size, hot_min_count, sync (herald: dense|sparse|mixed), lr, multi_hot, steps,
    stock_tables (herald: ``(stock mode, k)``: every k-th table keeps that stock plan's sharding, one EBC mixed),
    device (cpu|cuda: where every rank keeps its rows; the GPU check runs two gloo ranks on one GPU),
    torch_ids (herald: the id bookkeeping and the row store's gathers and scatters by the torch ops, as for
    ids and rows on a GPU, not the compiled passes),
    ids_in_thread (herald: the per-step input dist on the module's worker thread, as for ids on a GPU)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.pipeline.context import find_herald_ebc
    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.dense_sync import ForwardOrderedDenseSync, dense_optimizer_for

    B = cfg.get("batch_size", 32)
    data = data if data is not None else make_data(cfg)
    tables = build_tables(data.feature_names, data.num_embeddings, 8, cfg.get("pooling", "SUM"))
    model = build_dlrm_train(tables, data.num_dense, [16, 8], [16, 1], seed=0, device="cpu")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt, lr = cfg.get("optimizer", "sgd"), cfg.get("lr", 0.05)
    fused = None
    if cfg.get("via", "apply") == "apply":
        cls = torch.optim.SGD if opt == "sgd" else RowWiseAdagrad
        kw = {"lr": lr} if opt == "sgd" else {"lr": lr, "eps": 1e-8}
        apply_optimizer_in_backward(cls, model.model.sparse_arch.embedding_bag_collection.parameters(), kw)
    else:
        fused = {"optimizer": EmbOptimType.EXACT_SGD if opt == "sgd" else EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 "learning_rate": lr, "eps": 1e-8}
    sharder = HeraldEmbeddingBagCollectionSharder(fused_params=fused)
    mode = "row_wise" if cfg["planner"] == "herald" else cfg["planner"]
    device = torch.device(cfg.get("device", "cpu"))
    plan = stock_plan(model, tables, [sharder], mode, world, B, device, dist.group.WORLD)
    if cfg["planner"] == "herald":
        plan = herald_plan_from_row_wise(plan, hot_specs_from_data(data, tables, cfg.get("hot_min_count", 2),
                                                                   cfg.get("sync", "dense")))
        if cfg.get("stock_tables"):  # per-table: these tables keep a stock sharding beside herald's
            kind, every = cfg["stock_tables"]
            stock = stock_plan(model, tables, [sharder], kind, world, B, device, dist.group.WORLD)
            for path, module_plan in plan.plan.items():
                for i, t in enumerate(tables):
                    if i % every == every - 1:
                        module_plan[t.name] = stock.plan[path][t.name]
    dense_mode = cfg.get("dense_sync", "ddp")
    sync = ForwardOrderedDenseSync() if dense_mode.startswith("forward_ordered") else None
    if sync is not None:  # forward_ordered_in_backward: each group's sum starts in backward (HET's plan does)
        sync.start_in_backward = dense_mode == "forward_ordered_in_backward"
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder], data_parallel_wrapper=sync)
    dmp.load_state_dict(dict(initial))  # a copy: TorchRec's DMP.load_state_dict renames the DDP keys in place
    if cfg.get("torch_ids", False) and cfg.get("planner") == "herald":  # the path of ids and rows on a GPU:
        ebc = find_herald_ebc(dmp)  # the id bookkeeping and the row store's gathers and scatters by torch ops
        ebc._native_ids = ebc._store.native = None
    if cfg.get("ids_in_thread", False):  # the per-step input dist on the module's worker thread (a GPU's default)
        find_herald_ebc(dmp).input_dist_in_thread = True
    dense_cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adagrad
    dense = dense_optimizer_for(dmp, lambda ps: dense_cls(ps, lr=lr))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return {"dmp": dmp, "optimizer": optimizer, "data": data, "tables": tables, "plan": plan,
            "initial": initial, "batch_size": B, "device": device}


def run_steps(dmp: Any, optimizer: Any, it: Iterator[Any], pipeline: str = "plain",
              device: torch.device = torch.device("cpu")) -> List[float]:
    """Train on every batch of ``it`` on ``device``; per-step local losses."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    losses: List[float] = []
    if pipeline == "herald" or isinstance(pipeline, dict):
        from torchrec_herald.pipeline import HeraldTrainPipeline

        pipe = HeraldTrainPipeline(dmp, optimizer, device, **(pipeline if isinstance(pipeline, dict) else {}))
        while True:
            try:
                losses.append(pipe.progress(it)[0].item())
            except StopIteration:
                break
        run_steps.last_pipeline = pipe  # type: ignore[attr-defined]
        return losses
    if pipeline == "plain":
        for batch in it:
            loss, _ = dmp(batch.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    else:
        pipe = TrainPipelineSparseDist(dmp, optimizer, device)
        while True:
            try:
                losses.append(pipe.progress(it)[0].item())
            except StopIteration:
                break
        pipe.detach()
    return losses


def train(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """cfg: as :func:`build`, plus pipeline (plain|sparse_dist), steps, exact_rw_mean (stock ROW_WISE
    with the exact MEAN divisor, see :func:`exact_row_wise_mean`)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_herald.traffic import TrafficMeter

    patch = exact_row_wise_mean() if cfg.get("exact_rw_mean", False) else contextlib.nullcontext()
    with patch:
        b = build(world, cfg)
        dmp = b["dmp"]
        with TrafficMeter(embedding_dim=8) as meter:
            losses = run_steps(dmp, b["optimizer"], b["data"].train_batches(rank, world, b["batch_size"]),
                               cfg.get("pipeline", "plain"), b["device"])
    from torchrec_herald.pipeline.context import find_herald_ebc

    ebc = find_herald_ebc(dmp) if cfg["planner"] == "herald" else None
    state = full_state(dmp)
    return {"losses": losses, "state": state, "initial": b["initial"], "traffic": meter.summary(),
            "hot_replica_gap": hot_replica_gap(ebc, state) if ebc is not None and ebc._num_hot else None,
            "worker_used": ebc is not None and ebc._worker is not None, "num_hot": ebc._num_hot if ebc is not None else 0,
            "table_traffic": ebc.traffic_by_table() if ebc is not None else {},
            "tags": meter.tag_summary(), "dense_names": sorted(dict(in_backward_optimizer_filter(dmp.named_parameters())))}


def train_many(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``train`` for each cfg in turn, in one process group (saves a spawn + import per run)."""
    return [train(rank, world, cfg) for cfg in cfgs]


def preflight_error(overrides: List[str]) -> str:
    """``"<Type>: <message>"`` of the error ``preflight`` raises for the command line ``overrides``, or
    ``"no error"``."""
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import preflight

    try:
        preflight(compose_config(overrides))
    except Exception as e:  # noqa: BLE001 - the message is what is asserted
        return f"{type(e).__name__}: {e}"
    return "no error"


class QueuedDevice:
    """A device whose work the host only queues (as a GPU's stream): each step queues ``step_s`` of it, and a
    sync waits for whatever is queued."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.queued, self.synced_before = step_s, 0.0, []
        self.steps = 0

    def sync(self) -> None:
        time.sleep(self.queued)
        self.queued = 0.0
        self.synced_before.append(self.steps)
