"""One EmbeddingBagCollection, two shardings: herald's tables beside tables TorchRec shards as it ships.

The model of time picks a sharding per table (``planner/time_model.py``): herald's hot replication where
it saves time, a stock TABLE_WISE / ROW_WISE / COLUMN_WISE sharding where herald's extra work costs more
than its bytes save. :class:`ShardedMixedEmbeddingBagCollection` shards such an EBC as two sharded
modules over its two sets of tables and presents them as the one EBC the user built: the same input
KJT, the same ``KeyedTensor`` out (features in the EBC's order), the same ``state_dict`` keys and one
fused optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import (
    LazyAwaitable,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Multistreamable

from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, MIXABLE_STOCK_TYPES, table_of_state_key

__all__ = ["MIXABLE_STOCK_TYPES", "ShardedMixedEmbeddingBagCollection", "sub_collection"]



def sub_collection(module: EmbeddingBagCollection, names: List[str]) -> EmbeddingBagCollection:
    """An EBC over the tables ``names`` of ``module`` that shares ``module``'s table modules (their
    weights and any ``apply_optimizer_in_backward`` optimizer): nothing is copied or allocated."""
    configs = [c for c in module.embedding_bag_configs() if c.name in names]
    sub = EmbeddingBagCollection(tables=configs, is_weighted=module.is_weighted(), device=torch.device("meta"))
    for c in configs:
        sub.embedding_bags[c.name] = module.embedding_bags[c.name]
    sub._device = module.device  # noqa: SLF001 - the sharders read where the tables were built
    return sub


@dataclass
class MixedContext(Multistreamable):
    """Per-batch state of the two parts: each one's own sharding context."""

    herald: Any = None
    stock: Any = None
    n_herald: int = 0  # the herald part's entries at the front of the input dist's awaitables

    @property
    def sharding_contexts(self) -> List[Any]:
        """Aligned with the input dist's awaitables (TorchRec sets the stock part's contexts through it)."""
        return [None] * self.n_herald + list(getattr(self.stock, "sharding_contexts", []))

    def record_stream(self, stream: torch.Stream) -> None:
        for part in (self.herald, self.stock):
            if part is not None:
                part.record_stream(stream)


class _Merged(LazyAwaitable[KeyedTensor]):
    """The two parts' pooled embeddings as one ``KeyedTensor`` in the EBC's feature order."""

    def __init__(self, herald: LazyAwaitable[KeyedTensor], stock: LazyAwaitable[KeyedTensor], keys: List[str]) -> None:
        super().__init__()
        self._herald, self._stock, self._keys = herald, stock, keys

    def _wait_impl(self) -> KeyedTensor:
        parts = [self._herald.wait(), self._stock.wait()]  # LazyAwaitable.wait: the KeyedTensor
        values = KeyedTensor.regroup(parts, [self._keys])[0]
        dims = {k: d for kt in parts for k, d in zip(kt.keys(), kt.length_per_key())}
        return KeyedTensor(keys=list(self._keys), length_per_key=[dims[k] for k in self._keys], values=values)


class ShardedMixedEmbeddingBagCollection(
    ShardedModule[KJTList, Tuple[Any, Any], KeyedTensor, MixedContext], FusedOptimizerModule,
):
    """An EBC whose plan gives some tables :data:`HERALD_HOT_ROW_WISE` and the others a stock sharding
    (:data:`MIXABLE_STOCK_TYPES`), built by ``HeraldEmbeddingBagCollectionSharder``.

    ``herald`` is a :class:`~torchrec_herald.sharding.ShardedHeraldEmbeddingBagCollection` over the herald
    tables (the module ``HeraldTrainPipeline`` schedules), ``stock`` TorchRec's
    ``ShardedEmbeddingBagCollection`` over the rest. Each gets the input's features of its own tables
    and runs its own input dist, lookups and output dist (herald's first, on every rank); the outputs
    are merged into one ``KeyedTensor`` in the EBC's feature order. ``state_dict`` and ``load_state_dict``
    are the two parts' under the EBC's own names (``embedding_bags.<table>.weight``), so checkpoints move
    between this and any other plan; the fused optimizer combines the parts'. Parameters keep their
    parts' names (``herald.`` / ``stock.``), all of them sharded: DDP and the dense sync leave them alone.
    """

    def __init__(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
                 device: Optional[torch.device], make_herald: Callable[..., ShardedModule],
                 make_stock: Callable[..., ShardedModule], module_fqn: Optional[str] = None) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        herald = [c.name for c in configs if params[c.name].sharding_type == HERALD_HOT_ROW_WISE]
        stock = [c.name for c in configs if c.name not in herald]
        bad = {n: params[n].sharding_type for n in stock if params[n].sharding_type not in MIXABLE_STOCK_TYPES}
        if bad:
            raise ValueError(f"tables {sorted(bad)} have sharding types {sorted(set(bad.values()))}, which cannot sit "
                             f"beside {HERALD_HOT_ROW_WISE} tables {sorted(herald)} in one EBC (allowed: "
                             f"{', '.join(MIXABLE_STOCK_TYPES)}); give a small table to herald with every row hot "
                             f"instead of DATA_PARALLEL")
        self._features = [f for c in configs for f in c.feature_names]
        self._herald_features = [f for c in configs if c.name in herald for f in c.feature_names]
        self._stock_features = [f for c in configs if c.name not in herald for f in c.feature_names]
        self.herald_tables, self.stock_tables = herald, stock
        self.herald = make_herald(sub_collection(module, herald), {n: params[n] for n in herald}, env, device)
        self.stock = make_stock(sub_collection(module, stock), {n: params[n] for n in stock}, env, device, module_fqn)
        self._optim = CombinedOptimizer([("", self.herald.fused_optimizer), ("", self.stock.fused_optimizer)])
        # the input's key order and, for it, the positions of each part's features
        self._permute_keys: List[str] = []
        self._permute: Tuple[List[int], List[int]] = ([], [])

    # ------------------------------------------------------------------ ShardedModule API
    def create_context(self) -> MixedContext:
        return MixedContext(self.herald.create_context(), self.stock.create_context())

    def _split(self, features: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        keys = features.keys()
        if self._permute_keys != keys:
            missing = [f for f in self._features if f not in keys]
            if missing:
                raise ValueError(f"features {missing} of the EBC are missing from the input KJT")
            self._permute = ([keys.index(f) for f in self._herald_features], [keys.index(f) for f in self._stock_features])
            self._permute_keys = list(keys)
        return features.permute(self._permute[0]), features.permute(self._permute[1])

    def input_dist(self, ctx: MixedContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable[MixedContext]:
        """Each part's input dist on its own features (herald's first), as one stock
        ``KJTListSplitsAwaitable`` of both parts' awaitables: TorchRec's train pipeline fuses the stock
        part's splits all-to-all with other modules' as it would the EBC's own."""
        mine, theirs = self._split(features)
        first = self.herald.input_dist(ctx.herald, mine)
        second = self.stock.input_dist(ctx.stock, theirs)
        for part, req in (("herald", first), ("stock", second)):
            if not isinstance(req, KJTListSplitsAwaitable):  # both TorchRec 1.8 and 1.9 return one
                raise TypeError(f"the {part} part's input_dist returned {type(req).__name__}, expected "
                                f"KJTListSplitsAwaitable")
        ctx.n_herald = len(first.awaitables)
        return KJTListSplitsAwaitable(list(first.awaitables) + list(second.awaitables), ctx)

    def _parts(self, ctx: MixedContext, dist_input: KJTList) -> Tuple[KJTList, KJTList]:
        n = ctx.n_herald
        items = [dist_input[i] for i in range(len(dist_input))]
        return KJTList(items[:n]), KJTList(items[n:])

    def compute(self, ctx: MixedContext, dist_input: KJTList) -> Tuple[Any, Any]:
        mine, theirs = self._parts(ctx, dist_input)
        return self.herald.compute(ctx.herald, mine), self.stock.compute(ctx.stock, theirs)

    def output_dist(self, ctx: MixedContext, output: Tuple[Any, Any]) -> LazyAwaitable[KeyedTensor]:
        return _Merged(self.herald.output_dist(ctx.herald, output[0]), self.stock.output_dist(ctx.stock, output[1]),
                       self._features)

    def compute_and_output_dist(self, ctx: MixedContext, dist_input: KJTList) -> LazyAwaitable[KeyedTensor]:
        mine, theirs = self._parts(ctx, dist_input)
        return _Merged(self.herald.compute_and_output_dist(ctx.herald, mine),
                       self.stock.compute_and_output_dist(ctx.stock, theirs), self._features)

    # ------------------------------------------------------------------ the EBC's names for the two parts
    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "",
                   keep_vars: bool = False) -> Dict[str, Any]:  # type: ignore[override]
        """Both parts' ``{prefix}embedding_bags.<table>.weight`` (herald's, then stock's)."""
        destination = {} if destination is None else destination
        self.herald.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        self.stock.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return destination

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:  # type: ignore[override]
        """Each part loads its own tables' keys; a key of neither part is unexpected."""
        from torch.nn.modules.module import _IncompatibleKeys

        def owned(tables: List[str]) -> Dict[str, Any]:
            return {k: v for k, v in state_dict.items() if table_of_state_key(k) in tables}

        missing: List[str] = []
        for part, tables in ((self.herald, self.herald_tables), (self.stock, self.stock_tables)):
            got = part.load_state_dict(owned(tables), strict=False)
            missing += list(getattr(got, "missing_keys", []))
        unexpected = sorted(k for k in state_dict if table_of_state_key(k) not in self.herald_tables + self.stock_tables)
        if strict and (missing or unexpected):
            raise RuntimeError(f"mixed EBC load_state_dict: missing {sorted(missing)}, unexpected {unexpected}")
        return _IncompatibleKeys(sorted(missing), unexpected)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    def reset_parameters(self) -> None:
        for part in (self.herald, self.stock):
            part.reset_parameters()

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

