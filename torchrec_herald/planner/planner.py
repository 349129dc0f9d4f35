"""HeraldPlanner: TorchRec's planner plus P²RES hot-row selection (item-wise two-fold parallelism).

The stock planner lays out every table ROW_WISE (cold rows); a :class:`HotSetSelector` (the cost model by
default) picks each table's replicated hot rows under a per-rank memory budget; the result is a stock
``ShardingPlan`` whose tables are :data:`HERALD_HOT_ROW_WISE` with their hot sets attached.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import PlannerError, Stats, Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.comm import FLOAT_BYTES, ring_allreduce_bytes
from torchrec_herald.planner.convert import herald_plan_from_row_wise
from torchrec_herald.planner.hot_set import (
    CostModelHotSetSelector,
    HotSetChoice,
    HotSetSelector,
    format_traffic_report,
)
from torchrec_herald.planner.pricing import LinkModel, is_number
from torchrec_herald.planner.types import PlanDecision, herald_tables
from torchrec_herald.planner.stats import AccessStats
from torchrec_herald.planner.topology import default_storage_reservation, make_topology
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, MIXABLE_STOCK_TYPES, HotSpec, feature_read_twice

logger = logging.getLogger(__name__)

#: default per-rank memory for hot replicas (weights + row-wise Adagrad state)
DEFAULT_HOT_MEMORY_BUDGET_BYTES = 64 * 1024 * 1024


def embedding_bag_configs(module: nn.Module) -> List[EmbeddingBagConfig]:
    """All EmbeddingBagConfigs of the EBCs inside ``module`` (herald plans every EBC's tables, by name: a name two
    EBCs give their tables is refused, naming both)."""
    where: Dict[str, str] = {}
    configs = []
    for fqn, m in module.named_modules():
        if not isinstance(m, EmbeddingBagCollection):
            continue
        for c in m.embedding_bag_configs():
            if c.name in where:
                raise ValueError(f"HeraldPlanner: EBCs {where[c.name] or '(the model)'!r} and {fqn or '(the model)'!r} "
                                 f"both have a table named {c.name!r}; herald plans the tables of every EBC by name "
                                 f"(hot sets, constraints): give each table a name of its own")
            where[c.name] = fqn
            configs.append(c)
    return configs


@dataclasses.dataclass(frozen=True)
class _PlanningError:
    """Rank 0's planning error, broadcast to every rank (:meth:`HeraldPlanner.collective_plan`)."""

    message: str
    kind: str = "ValueError"


def _check_one_table_a_feature(module: nn.Module, kept: set) -> None:
    """Herald's sharding maps each KJT key to one table of its EBC: ValueError naming the EBC, the key and the
    tables where two of one EBC's herald tables read one key (TorchRec allows it; two EBCs may)."""
    for fqn, m in module.named_modules():
        if not isinstance(m, EmbeddingBagCollection):
            continue
        twice = feature_read_twice(c for c in m.embedding_bag_configs() if c.name not in kept)
        if twice is not None:
            raise ValueError(f"HeraldPlanner: EBC {fqn or '(the model)'!r}: feature {twice[0]!r} is read by two of its "
                             f"tables, {twice[1]!r} and {twice[2]!r}; herald's sharding maps a feature to one table: "
                             f"keep one of them stock (ParameterConstraints(sharding_types=[...]) without row_wise), "
                             f"or put it in an EBC of its own")


def check_hot_budget_fits(budget: Optional[int], topology: Topology, key: str = "hot_memory_budget_bytes") -> None:
    """ValueError naming ``key`` where a hot-row budget of ``budget`` bytes is more than a rank of ``topology``
    holds (its HBM on a GPU, its DDR on a CPU)."""
    if budget is None:
        return
    device = topology.devices[0]
    capacity = device.storage.hbm if topology.compute_device == "cuda" else device.storage.ddr
    if budget > capacity:
        raise ValueError(f"{key}={budget} is more than a rank can hold ({capacity} bytes of "
                         f"{'HBM' if topology.compute_device == 'cuda' else 'DDR'} per rank in the planner's Topology)")


class HeraldPlanner(EmbeddingShardingPlanner):
    """Drop-in for ``EmbeddingShardingPlanner`` (same arguments, ``stats`` still TorchRec's planner
    ``Stats`` reporters) plus herald's: ``access_stats`` (an :class:`AccessStats`) or ``sample_batches``
    to count them from (:meth:`from_batches`), ``hot_memory_budget_bytes``, ``hot_set_selector``, and
    ``link`` / ``dense_sync`` for :meth:`decide`.

    ``plan()`` / ``collective_plan()`` return a ``ShardingPlan`` for
    ``DistributedModelParallel(module, plan=plan, sharders=[HeraldEmbeddingBagCollectionSharder()])``.
    Each table is :data:`HERALD_HOT_ROW_WISE`: its hot rows replicated, its cold rows in stock
    ROW_WISE's block layout. A table where replication does not pay gets no hot rows (cold path
    only). If the budget cannot hold a single hot row no table gets any (a warning names the smallest
    budget that would): still a herald plan, whose cold rows ``pipeline=herald`` caches and plans; a
    budget larger than a rank's memory is an error. ``last_choices`` /
    :meth:`describe` explain the plan: per table the hot rows, replica bytes per rank and the
    expected traffic per step, stock vs herald. :meth:`decide` also prices the link and may choose a
    stock plan (TABLE_WISE or TorchRec's default) or a per-table mix instead (a typed
    :class:`~torchrec_herald.planner.types.PlanDecision`).
    """

    #: log the plan's per-table table (False: one line, where the same job logged the same plan already)
    log_plan_table: bool = True

    def __init__(self, *args: Any, access_stats: Optional[AccessStats] = None,
                 stats: Union[Stats, List[Stats], None] = None,
                 hot_memory_budget_bytes: Optional[int] = DEFAULT_HOT_MEMORY_BUDGET_BYTES,
                 hot_set_selector: Optional[HotSetSelector] = None,
                 sample_batches: Optional[Sequence[Any]] = None, link: Optional[LinkModel] = None,
                 dense_sync: str = "forward_ordered", **kwargs: Any) -> None:
        if isinstance(stats, AccessStats):
            raise TypeError("HeraldPlanner: pass access statistics as access_stats=...; stats= is TorchRec's "
                            "planner Stats reporters")
        access = access_stats
        kwargs.setdefault("storage_reservation", default_storage_reservation())
        super().__init__(*args, stats=stats, **kwargs)
        if access is None and not sample_batches:
            raise ValueError("HeraldPlanner needs access statistics: HeraldPlanner.from_batches(sample_batches, ...) "
                             "or access_stats=AccessStats.from_batches(sample_batches, tables)")
        if hot_memory_budget_bytes is not None and hot_memory_budget_bytes < 0:
            raise ValueError(f"hot_memory_budget_bytes must be >= 0, got {hot_memory_budget_bytes}")
        self._access_stats = access
        self._sample_batches = list(sample_batches or [])
        if link is not None and not isinstance(link, LinkModel):
            raise TypeError(f"HeraldPlanner(link=...) takes a LinkModel (e.g. LinkModel(link_mbit=200)) or None, got "
                            f"{link!r}")
        # a rate stated in TorchRec's Topology (intra_host_bw / inter_host_bw) is the link when none is given
        self.link = link if link is not None else link_from_topology(self._topology)
        self.dense_sync = dense_sync
        self._budget = hot_memory_budget_bytes
        self._selector = hot_set_selector or CostModelHotSetSelector(pricing=self.link)
        self.last_choices: Dict[str, HotSetChoice] = {}
        self._check_budget_fits()

    @classmethod
    def from_batches(cls, batches: Iterable[Any], num_batches: int = 20, *, world_size: Optional[int] = None,
                     compute_device: Optional[str] = None, **kwargs: Any) -> "HeraldPlanner":
        """A planner whose access statistics are counted from ``batches``, the adoption path of a
        script that never built a planner (DMP planned for it)::

            plan = HeraldPlanner.from_batches(itertools.islice(dataset, 20)).collective_plan(model, [sharder])

        Args:
            batches: sample batches (``torchrec.datasets.utils.Batch`` or ``KeyedJaggedTensor``), e.g. a
                fresh iterator over the training data; the first ``num_batches`` are read. The global
                random generator is left as it was, so a model built after planning initialises as it
                would without the planner.
            num_batches: how many batches to count (``>= 1``).
            world_size, compute_device: the ``Topology`` when ``topology=`` is not given (default:
                the process group's size; ``cuda`` when a GPU is visible).
            kwargs: ``HeraldPlanner`` / ``EmbeddingShardingPlanner`` arguments; ``batch_size``
                defaults to the sample batches' size.

        The counts are taken at :meth:`plan` time over the module's tables; with ``collective_plan``
        rank 0's sample decides, as rank 0's plan does."""
        for name, value, low in (("num_batches", num_batches, 1), ("world_size", world_size, 1),
                                 ("batch_size", kwargs.get("batch_size"), 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"HeraldPlanner.from_batches: {name} must be an integer >= {low}, got {value!r}")
        if compute_device not in (None, "cpu", "cuda"):
            raise ValueError(f"HeraldPlanner.from_batches: compute_device must be 'cpu' or 'cuda', got {compute_device!r}")
        with torch.random.fork_rng(devices=[]):  # a data loader drawing from the global generator
            sample = [getattr(b, "sparse_features", b) for b in itertools.islice(iter(batches), int(num_batches))]
        if not sample:
            raise ValueError("HeraldPlanner.from_batches: the batches iterable yielded no batch")
        bad = [type(b).__name__ for b in sample if not isinstance(b, KeyedJaggedTensor)]
        if bad:
            raise ValueError(f"HeraldPlanner.from_batches: expected Batch or KeyedJaggedTensor items, got {bad[0]}")
        if kwargs.get("topology") is None:
            kwargs["topology"] = make_topology(world_size, compute_device)
        kwargs.setdefault("batch_size", int(sample[0].stride()))
        return cls(sample_batches=sample, **kwargs)

    def _check_budget_fits(self) -> None:
        check_hot_budget_fits(self._budget, self._topology)

    def _types_given(self, name: str) -> List[str]:
        """The sharding types table ``name``'s ``ParameterConstraints`` name ([]: none given)."""
        given = (self._constraints or {}).get(name)
        return (given.sharding_types or []) if given is not None else []

    def _kept_stock(self, tables: List[EmbeddingBagConfig]) -> set:
        """Tables whose user constraints name sharding types, none of them ROW_WISE or herald's."""
        own = {ShardingType.ROW_WISE.value, HERALD_HOT_ROW_WISE}
        return {t.name for t in tables if (types := self._types_given(t.name)) and not own & set(types)}

    def _beside_herald(self, module: nn.Module, kept: set, also_stock: Iterable[str] = ()) -> Dict[str, List[str]]:
        """Of the ``kept`` tables, those in an EBC with herald tables (tables neither ``kept`` nor ``also_stock``),
        each with the sharding types its constraints allow that can sit beside them (:data:`MIXABLE_STOCK_TYPES`).
        ValueError naming a table whose constraints allow none (DATA_PARALLEL alone)."""
        stock = set(kept) | set(also_stock)
        out: Dict[str, List[str]] = {}
        for m in module.modules():
            if not isinstance(m, EmbeddingBagCollection):
                continue
            names = [c.name for c in m.embedding_bag_configs()]
            if all(n in stock for n in names):
                continue  # (an EBC of stock tables alone: TorchRec shards it, any type)
            for n in names:
                if n not in kept:
                    continue
                given = self._types_given(n)
                allowed = [t for t in given if t in MIXABLE_STOCK_TYPES]
                if not allowed:
                    raise ValueError(f"table {n}: its ParameterConstraints allow {given}, which cannot sit beside "
                                     f"herald tables in one EBC (its own DDP would sync it outside herald's dense "
                                     f"sync); allow one of {list(MIXABLE_STOCK_TYPES)}, or put it in an EBC of its own")
                out[n] = allowed
        return out

    def _mixable(self, name: str, why: str, fix: str) -> List[str]:
        """The stock types table ``name`` may take beside herald's tables in one EBC: its constraints' mixable types,
        else (no types given) any mixable type. ValueError naming the table where its constraints name types and none
        of them can sit there (herald's alone, say): ``why`` it cannot be herald's, ``fix`` the other way out."""
        types = self._types_given(name)
        allowed = [t for t in types if t in MIXABLE_STOCK_TYPES]
        if types and not allowed:
            raise ValueError(f"table {name}: its ParameterConstraints allow {types}, but {why}; allow a stock type that "
                             f"can sit beside herald's tables ({list(MIXABLE_STOCK_TYPES)}), or {fix}")
        return allowed or list(MIXABLE_STOCK_TYPES)

    def _weighted(self, module: nn.Module, kept: set) -> Dict[str, None]:
        """Herald's sharding has no per-sample weights: the tables (``kept`` aside) of a weighted EBC
        (``is_weighted=True``) keep the stock types TorchRec picks for them (the value None: no herald table sits in
        that EBC), said in one line (herald's sharder refuses a plan giving them its type)."""
        out: Dict[str, None] = {}
        for fqn, m in module.named_modules():
            if isinstance(m, EmbeddingBagCollection) and m.is_weighted():
                names = [c.name for c in m.embedding_bag_configs() if c.name not in kept]
                for n in names:  # (kept: constraints that name stock types; these name herald's alone, or none)
                    types = self._types_given(n)
                    if types and all(t == HERALD_HOT_ROW_WISE for t in types):
                        raise ValueError(f"table {n}: its ParameterConstraints allow {types}, but its EBC "
                                         f"{fqn or '(the model)'!r} is weighted (is_weighted=True), and herald's "
                                         f"sharding has no per-sample weights; allow a stock sharding type")
                out.update(dict.fromkeys(names))
                if names:
                    logger.info("HeraldPlanner: EBC %r is weighted (is_weighted=True), and herald's sharding has no "
                                "per-sample weights: its tables %s keep a stock type", fqn or "(the model)",
                                ", ".join(names))
        return out

    def _not_fp32(self, module: nn.Module, kept: set) -> Dict[str, Optional[List[str]]]:
        """Herald's rows are FP32: each table (``kept`` aside) of another ``data_type`` (FP16, INT8, ...) keeps a
        stock type, which stores and updates it in its own precision, said in one line. The value: the types it may
        take beside herald's tables in its EBC (None: its EBC has none, TorchRec picks any)."""
        out: Dict[str, Optional[List[str]]] = {}
        said: List[str] = []
        for m in module.modules():
            if not isinstance(m, EmbeddingBagCollection):
                continue
            configs = m.embedding_bag_configs()
            low = [c for c in configs if c.name not in kept and c.data_type != DataType.FP32]
            alone = all(c.name in kept or c in low for c in configs)
            for c in low:
                said.append(f"{c.name} ({c.data_type.name})")
                if alone:  # (no herald table beside it: TorchRec picks any type)
                    out[c.name] = None
                    continue
                out[c.name] = self._mixable(c.name, f"it is {c.data_type.name}, and herald's sharding holds FP32 rows",
                                            "make it FP32")
        if said:
            logger.info("HeraldPlanner: herald's sharding holds FP32 rows; %s keep a stock type in their own precision",
                        ", ".join(said))
        return out

    def _other_dims(self, module: nn.Module, kept: set, stats: AccessStats) -> Dict[str, List[str]]:
        """Herald's sharding holds one embedding dim an EBC: of an EBC whose tables (``kept`` aside) have several,
        the dim whose tables' sampled lookups move the most bytes (lookups × dim) is herald's; the others' tables
        keep a stock type that can sit beside them (their constraints' mixable types, else any; ValueError where they
        allow none), said in one line."""
        out: Dict[str, List[str]] = {}
        for fqn, m in module.named_modules():
            if not isinstance(m, EmbeddingBagCollection):
                continue
            by_dim: Dict[int, List[str]] = {}
            for c in m.embedding_bag_configs():
                if c.name not in kept:
                    by_dim.setdefault(int(c.embedding_dim), []).append(c.name)
            if len(by_dim) < 2:
                continue
            herald_dim = max(by_dim, key=lambda d: (d * sum(stats.total_lookups(n) for n in by_dim[d]),
                                                    len(by_dim[d]), -d))
            for d, names in by_dim.items():
                for n in names if d != herald_dim else []:
                    out[n] = self._mixable(n, f"it is of dim {d}, and herald's sharding holds one dim an EBC (dim "
                                              f"{herald_dim} there: its tables' sampled lookups move the most bytes)",
                                           f"give it dim {herald_dim}, or put it in an EBC of its own")
            logger.info("HeraldPlanner: EBC %r has tables of embedding dims %s; herald's sharding holds one dim an EBC: "
                        "dim %d is herald's (its tables' sampled lookups move the most bytes), %s keep a stock type",
                        fqn or "(the model)", sorted(by_dim), herald_dim,
                        ", ".join(n for d, names in sorted(by_dim.items()) if d != herald_dim for n in names))
        return out

    def _row_wise_constraints(self, tables: List[EmbeddingBagConfig], beside: Optional[Dict[str, List[str]]] = None
                              ) -> Dict[str, ParameterConstraints]:
        """The constraints of the plan of herald's cold blocks: every herald table ROW_WISE, the kept tables
        beside them their mixable types (``beside``), a user's other fields kept."""
        constraints = copy.deepcopy(self._constraints) if self._constraints else {}
        for name, allowed in (beside or {}).items():
            constraints.setdefault(name, ParameterConstraints()).sharding_types = list(allowed)
        for t in tables:
            pc = constraints.get(t.name, ParameterConstraints())
            pc.sharding_types = [ShardingType.ROW_WISE.value]
            # herald's blocks are fused TBEs in the device's memory: where they do not fit, TorchRec's planner says so
            # (a UVM-caching or key-value kernel it could pick instead would be allocated whole on the device)
            pc.compute_kernels = [EmbeddingComputeKernel.FUSED.value]
            constraints[t.name] = pc
        return constraints

    def collective_plan(self, module: nn.Module, sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
                        pg: Optional[dist.ProcessGroup] = None) -> ShardingPlan:
        """TorchRec's: rank 0 plans, every rank gets its plan. A ValueError of rank 0's planning (a constraint, a
        table name, a feature, the access stats; TorchRec's PlannerError, no plan fits) or TorchRec's RuntimeError (no
        sharding type a table's constraints allow) is raised on every rank alike, where TorchRec's would leave the
        others waiting in the broadcast until rank 0's process ended (or, under NCCL, its timeout)."""
        from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
        from torchrec.distributed.sharding_plan import get_default_sharders

        def plan_or_error() -> Union[ShardingPlan, _PlanningError]:
            try:
                return self.plan(module, sharders if sharders is not None else get_default_sharders())
            except (ValueError, PlannerError, RuntimeError) as e:  # (TorchRec's: no plan fits its storage; no type
                return _PlanningError(str(e), type(e).__name__)      # its constraints allow)

        outcome = invoke_on_rank_and_broadcast_result(pg if pg is not None else dist.GroupMember.WORLD, 0,
                                                      plan_or_error)
        if isinstance(outcome, _PlanningError):
            raise (RuntimeError if outcome.kind == "RuntimeError" else ValueError)(outcome.message)
        return outcome

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Herald's plan of ``module``: TorchRec's planner lays every EBC table out row-wise (the cold blocks; a
        user's other constraints kept), and each gets herald's type with the hot set the selector picks under
        the memory budget (``last_choices``). A table whose ``ParameterConstraints`` name sharding types
        without ROW_WISE (or herald's) keeps the stock type TorchRec picks among them, in the same EBC, as does a
        table of another precision than FP32, a weighted EBC's table, and a table of another embedding dim than its
        EBC's herald dim; other
        modules (an ``EmbeddingCollection``) are planned by TorchRec as they are."""
        stock_sharders = [_as_stock(s) for s in sharders]  # stock planning components know stock types only
        every = embedding_bag_configs(module)
        kept = self._kept_stock(every)
        weighted = self._weighted(module, kept)
        precision = {**self._not_fp32(module, kept | set(weighted)), **weighted}
        if all(t.name in kept or t.name in precision for t in every):
            return super().plan(module, stock_sharders)
        if kept:
            logger.info("HeraldPlanner: %d table(s) keep the stock sharding types their constraints name: %s",
                        len(kept), ", ".join(sorted(kept)))
        beside = self._beside_herald(module, kept, precision)
        stats = self.access_stats(every)
        stats.validate(every)
        kept, beside = kept | set(precision), {**beside, **{n: t for n, t in precision.items() if t is not None}}
        other_dims = self._other_dims(module, kept, stats)
        kept, beside = kept | set(other_dims), {**beside, **other_dims}
        _check_one_table_a_feature(module, kept)
        tables = [t for t in every if t.name not in kept]
        stats = stats.only(t.name for t in tables) if kept else stats
        choices = self._selector.select(stats, tables, self._topology.world_size, self._batch_size, self._budget)
        self.last_choices = choices
        # cold layout: TorchRec's own planner with every table ROW_WISE (its enumerator is built with
        # the constraints, hence a second planner rather than swapping ours)
        row_wise = EmbeddingShardingPlanner(topology=self._topology, batch_size=self._batch_size,
                                            storage_reservation=self._storage_reservation,
                                            constraints=self._row_wise_constraints(tables, beside)
                                            ).plan(module, stock_sharders)
        hot = {name: HotSpec(c.hot_ids, sync=c.sync, expected=c.expected.as_dict()) for name, c in choices.items()}
        ebcs = {fqn for fqn, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)}
        plan = herald_plan_from_row_wise(row_wise, hot, modules=ebcs, keep=kept)
        if self.log_plan_table:
            logger.info("HeraldPlanner: %s tables\n%s", len(tables), self.describe())
        else:
            logger.info("HeraldPlanner: %s tables, the plan this job logged first (in the approximate run's log)",
                        len(tables))
        return plan

    def decide(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]],
               pg: Optional[dist.ProcessGroup] = None) -> PlanDecision:
        """Plan ``module`` (collectively when ``pg`` is given) and decide what trains it by the model of
        time (``planner/time_model.py``): herald's plan, stock TABLE_WISE, TorchRec's default plan or
        herald's tables beside stock ones, the one with the shortest predicted step on the link (``link``,
        or the bandwidth stated in the planner's TorchRec ``Topology``), except that TorchRec's default plan
        must beat TABLE_WISE by more than one collective's latency (``time_model.choose_plan``); the
        decision carries every candidate's predicted step and says why in one line. Every rank must be given
        the same link (checked: one ValueError on every rank)."""
        from torchrec_herald.planner.stock import describe_plan, stock_plan
        from torchrec_herald.planner.time_model import decide, default_plan_load, mixed_plan_load, per_table_choice

        if pg is not None:
            self._check_every_rank_has_this_link(pg)
        plan = self.collective_plan(module, sharders, pg) if pg is not None else self.plan(module, sharders)
        if self.link is None:
            return PlanDecision(plan=plan, sharders=sharders, dense_sync=self.dense_sync)
        W = self._topology.world_size
        tables = embedding_bag_configs(module)
        expected = {name: s.expected for name, s in herald_tables(plan).items()}
        dense = dense_allreduce_bytes(module, W)
        stock_sharders = [_as_stock(s) for s in sharders]
        device = torch.device("cuda" if self._topology.compute_device == "cuda" else "cpu")
        user = {"topology": self._topology, "storage_reservation": self._storage_reservation,
                "constraints": self._constraints}  # (the stock candidates are what TorchRec plans for them)
        default = stock_plan(module, tables, stock_sharders, "default", W, self._batch_size, device, pg, **user)
        default_types = describe_plan(default)
        load = default_plan_load(default_types, expected,
                                 {t.name: float(FLOAT_BYTES * t.num_embeddings * t.embedding_dim) for t in tables}, W,
                                 dense)
        pick = per_table_choice(expected, default_types, W, self.link, dense, self.dense_sync)
        mixed = None  # per table: only where some tables go each way (else it is one of the whole plans)
        if len({k == "herald" for k in pick.values()}) == 2:
            mixed = (mixed_plan_load(expected, pick, W, dense, self.dense_sync), pick)
        link = decide(expected.values(), W, self.link, dense_bytes=dense, dense_sync=self.dense_sync,
                      default_plan=load, mixed=mixed)
        logger.info("planner: %s", link.describe())
        if link.chosen == "herald":
            return PlanDecision(plan=plan, sharders=sharders, dense_sync=self.dense_sync, link=link)
        if link.chosen == "mixed":  # TABLE_WISE planned only for tables whose default-plan type is another
            needs_tw = any(k not in ("herald", default_types[n]) for n, k in pick.items())
            table_wise = (stock_plan(module, tables, stock_sharders, "table_wise", W, self._batch_size, device, pg,
                                     **user) if needs_tw else None)
            return PlanDecision(plan=mixed_plan(plan, pick, default, table_wise), sharders=sharders,
                                dense_sync=self.dense_sync, link=link)
        if link.chosen == "default":
            return PlanDecision(plan=default, sharders=stock_sharders, dense_sync="ddp", link=link)
        table_wise = stock_plan(module, tables, stock_sharders, "table_wise", W, self._batch_size, device, pg, **user)
        return PlanDecision(plan=table_wise, sharders=stock_sharders, dense_sync="ddp", link=link)

    def _check_every_rank_has_this_link(self, pg: dist.ProcessGroup) -> None:
        """Every rank decides on its own link (collective): ranks given different links would pick different
        plans and wait in different collectives. Raises the same ValueError on every rank where they differ."""
        links: List[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(links, self.link, group=pg)
        if any(link != links[0] for link in links):
            given = "; ".join(f"rank {r}: {link}" for r, link in enumerate(links))
            raise ValueError(f"HeraldPlanner.decide: the ranks were given different links ({given}); give every rank "
                             f"the same link= (or the same Topology bandwidths)")

    def access_stats(self, tables: List[EmbeddingBagConfig]) -> AccessStats:
        """The statistics the hot sets are chosen from: those given, or the counts of the sample batches
        over ``tables`` (counted once)."""
        if self._access_stats is None:
            self._access_stats = AccessStats.from_batches(self._sample_batches, tables)
            self._sample_batches = []
        return self._access_stats

    def describe(self) -> str:
        """Per table: hot rows, sync, replica bytes per rank, expected bytes per step stock vs herald."""
        if not self.last_choices:
            return "(no herald tables planned)"
        return (f"sharding type of every table: {HERALD_HOT_ROW_WISE} (hot rows replicated on all "
                f"{self._topology.world_size} ranks, cold rows in stock ROW_WISE blocks); bytes per step, all ranks\n"
                + format_traffic_report(self.last_choices))


def mixed_plan(herald: ShardingPlan, pick: Dict[str, str], default: ShardingPlan,
               table_wise: Optional[ShardingPlan]) -> ShardingPlan:
    """``herald``'s plan with each table ``pick`` gives a stock type sharded as TorchRec's default plan
    shards it, where that is the type, else as ``table_wise`` shards it (needed only then)."""
    out = copy.deepcopy(herald)
    for path, module_plan in out.plan.items():
        for name, kind in pick.items():
            if kind == "herald" or name not in module_plan:
                continue
            source = default if default.plan[path][name].sharding_type == kind else table_wise
            assert source is not None, f"table {name}: {kind} is not its default-plan type; pass the TABLE_WISE plan"
            module_plan[name] = copy.deepcopy(source.plan[path][name])
    return out


def dense_allreduce_bytes(module: nn.Module, world_size: int) -> float:
    """Bytes each rank sends per step to all-reduce ``module``'s dense parameters (everything outside its
    EBCs; a ring all-reduce sends 2·(W−1)/W of the payload), as TrafficMeter counts them."""
    tables = {id(p) for m in module.modules() if isinstance(m, EmbeddingBagCollection) for p in m.parameters()}
    payload = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in tables)
    return ring_allreduce_bytes(payload, world_size)


def link_from_topology(topology: Any, cpu_us_per_lookup: float = LinkModel.cpu_us_per_lookup) -> Optional[LinkModel]:
    """The link a user stated in TorchRec's ``Topology``: ``inter_host_bw`` when the ranks span hosts,
    else ``intra_host_bw`` (TorchRec's unit, bytes per ms); None when that one is TorchRec's default (not
    stated; a warning where the other was stated: it is not the ranks' link)."""
    from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH

    for key in ("intra_host_bw", "inter_host_bw"):
        v = getattr(topology, key)
        if not is_number(v) or not 0 < v < math.inf:
            raise ValueError(f"HeraldPlanner: Topology.{key} must be a finite number > 0 (bytes per ms), got {v!r}")
    if topology.local_world_size is not None and not (isinstance(topology.local_world_size, int)
                                                      and topology.local_world_size >= 1):
        raise ValueError(f"HeraldPlanner: Topology.local_world_size must be an int >= 1 (ranks per host), got "
                         f"{topology.local_world_size!r}")
    intra, inter = float(topology.intra_host_bw), float(topology.inter_host_bw)
    spans_hosts = topology.world_size > (topology.local_world_size or topology.world_size)
    bw, default = (inter, CROSS_NODE_BANDWIDTH) if spans_hosts else (intra, INTRA_NODE_BANDWIDTH)
    if bw == default:
        if (intra, inter) != (INTRA_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH):
            stated, missing = ("intra_host_bw", "inter_host_bw") if spans_hosts else ("inter_host_bw", "intra_host_bw")
            logger.warning("HeraldPlanner: the Topology states %s, but its %d ranks %s (local_world_size=%s): their "
                           "link is %s, which it leaves at TorchRec's default; no link is taken from it (state %s, "
                           "set local_world_size to the ranks per host, or give link=)",
                           stated, topology.world_size,
                           f"span hosts of {topology.local_world_size}" if spans_hosts else "share one host",
                           topology.local_world_size, missing, missing)
        return None
    return LinkModel(link_mbit=bw * 1000 * 8 / 1e6, collective_latency_ms=LinkModel.collective_latency_ms,
                     cpu_us_per_lookup=cpu_us_per_lookup)


def _as_stock(sharder: ModuleSharder[nn.Module]) -> ModuleSharder[nn.Module]:
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder, HeraldEmbeddingBagCollectionSharder

    if isinstance(sharder, HeraldEmbeddingBagCollectionSharder):
        return CpuEmbeddingBagCollectionSharder(fused_params=sharder.fused_params)
    return sharder
