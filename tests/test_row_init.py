"""The model is built on ``meta`` and each rank fills only its shards from the per-row initialisation
(``torchrec_herald/row_init.py``): a row's values depend only on (seed, table, row), so every plan —
stock TABLE_WISE, ROW_WISE, TorchRec's default plan (``planner=stock``), herald's hot/cold layout — starts from identical
weights, and no rank holds a full copy of the model."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.row_init import ROWS_PER_DRAW, initial_rows


def test_a_row_range_equals_the_same_rows_drawn_in_any_other_split() -> None:
    n, dim = 3 * ROWS_PER_DRAW + 77, 5
    whole = initial_rows(7, "t_a", n, dim, 0, n)
    cuts = [0, 13, ROWS_PER_DRAW - 1, ROWS_PER_DRAW + 5, 2 * ROWS_PER_DRAW, n]
    parts = torch.cat([initial_rows(7, "t_a", n, dim, a, b) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(parts, whole)
    bound = (1.0 / n) ** 0.5
    assert float(whole.abs().max()) <= bound and float(whole.std()) > bound / 3


def test_rows_differ_by_seed_and_by_table() -> None:
    a = initial_rows(0, "t_a", 100, 4, 0, 100)
    assert not torch.equal(a, initial_rows(1, "t_a", 100, 4, 0, 100))
    assert not torch.equal(a, initial_rows(0, "t_b", 100, 4, 0, 100))
    assert torch.equal(a, initial_rows(0, "t_a", 100, 4, 0, 100))


def test_a_row_range_outside_the_table_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"table 't_a': rows \[5, 11\) outside \[0, 10\)"):
        initial_rows(0, "t_a", 10, 4, 5, 11)


def _initial_tables(rank: int, world: int, plans: List[str]) -> Dict[str, Any]:
    from herald_harness import gather_state

    from torchrec_herald.config import compose_config
    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.trainer import build_model_and_plan, preflight

    import torchrec_herald.row_init as row_init

    row_init.ROWS_PER_FILL = 1000  # (a table filled in many parts, across the draws' blocks: the same values)
    init_distributed()
    out: Dict[str, Any] = {}
    for p in plans:
        cfg = compose_config([f"planner={p}", "data.num_train_batches=4", "batch_size=64", "seed=3"]
                             + (["planner.link_mbit=null"] if p == "herald" else []))  # herald's plan on loopback
        data = preflight(cfg)
        dmp, _, _ = build_model_and_plan(cfg, data, world, torch.device("cpu"))
        state = gather_state(dmp.state_dict())
        emb = {k.split(".")[-2]: v for k, v in state.items() if ".embedding_bags." in k}
        dense = {k: v for k, v in state.items() if ".embedding_bags." not in k}
        meta = [n for n, prm in dmp.named_parameters() if prm.is_meta]
        hot = None
        from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

        for m in dmp.modules():
            if isinstance(m, ShardedHeraldEmbeddingBagCollection):
                # every hot replica equals its row's initial values
                hot = all(torch.equal(m.store.hot_block(t), emb[name][m.layout.hot_ids[t]])
                          for t, name in enumerate(m.layout.tables))
        out[p] = {"emb": emb, "dense": dense, "meta": meta, "hot_ok": hot,
                  "n": {name: int(n) for name, n in zip(data.feature_names, data.num_embeddings)}}
    return out


def test_every_plan_starts_from_identical_weights_equal_to_the_per_row_initialisation() -> None:
    plans = ["table_wise", "row_wise", "stock", "herald"]
    res = run_multiprocess(_initial_tables, 2, plans)
    r0 = res[0]
    ref = r0["table_wise"]
    assert len(ref["emb"]) == 26
    for p in plans:
        got = r0[p]
        assert got["meta"] == [], f"{p}: parameters left on meta: {got['meta']}"
        assert sorted(got["emb"]) == sorted(ref["emb"])
        for name, w in got["emb"].items():
            assert torch.equal(w, ref["emb"][name]), f"{p}: table {name} differs from table_wise's"
        for k, v in got["dense"].items():
            assert torch.equal(v, ref["dense"][k]), f"{p}: {k} differs"
    assert r0["herald"]["hot_ok"] is True
    # and the values are the per-row draws, whatever the plan
    for name, w in ref["emb"].items():
        n = w.shape[0]
        assert torch.equal(w, initial_rows(3, name, n, w.shape[1], 0, n)), name
    # rank 1 saw the same full tables
    for name, w in res[1]["herald"]["emb"].items():
        assert torch.equal(w, ref["emb"][name])


def _meta_built_tables(rank: int, world: int, init_fns: Dict[str, Any]) -> Dict[str, Any]:
    """A meta-built EBC sharded stock ROW_WISE and herald (hot rows in every table) from the same seed:
    both models' full tables and their hot replicas, and a draw from the global generator after each
    DMP (herald must leave it where stock does)."""
    import torch.distributed as dist
    from herald_harness import full_state
    from torchrec.distributed import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward

    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import (CpuEmbeddingBagCollectionSharder, HeraldEmbeddingBagCollectionSharder,
                                          HotSpec, ShardedHeraldEmbeddingBagCollection)

    sizes = {"t_a": 101, "t_b": 7, "t_c": 250, "t_d": 2}  # uneven blocks; t_d: a rank with no rows at W=3
    out: Dict[str, Any] = {}
    for kind in ("stock", "herald"):
        tables = [EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=r, feature_names=[f"f{i}"],
                                     init_fn=init_fns.get(n)) for i, (n, r) in enumerate(sizes.items())]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
        sharders: List[Any] = [CpuEmbeddingBagCollectionSharder()]
        plan = stock_plan(ebc, tables, sharders, "row_wise", world, 8, torch.device("cpu"), dist.group.WORLD)
        if kind == "herald":
            hot = {n: HotSpec(torch.tensor([0, r - 1, r // 2]).unique(), sync="dense") for n, r in sizes.items()}
            plan, sharders = herald_plan_from_row_wise(plan, hot), [HeraldEmbeddingBagCollectionSharder()]
        torch.manual_seed(11)
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders)
        after = torch.rand(4)
        state = {k.split(".")[-2]: v for k, v in full_state(dmp).items()}
        hot_ok = None
        for m in dmp.modules():
            if isinstance(m, ShardedHeraldEmbeddingBagCollection):
                hot_ok = all(torch.equal(m.store.hot_block(t), state[n][m.layout.hot_ids[t]])
                             for t, n in enumerate(m.layout.tables))
        out[kind] = {"tables": state, "after": after, "hot_ok": hot_ok}
    return out


def _constant_half(w: Any) -> Any:
    return torch.nn.init.constant_(w, 0.5)


@pytest.mark.parametrize("world", [2, 3])
def test_meta_built_tables_start_from_stock_row_wise_weights_under_herald(world: int) -> None:
    """A meta-built EBC sharded by herald's sharder initialises every row as stock TorchRec's ROW_WISE
    does for the same seed, bit for bit: the fused TBE's own draw, then each table's ``init_fn`` on the
    rank's block (a user's ``init_fn`` honoured: t_b normal, t_d constant); hot replicas equal their
    rows; the global generator ends where stock leaves it. (Herald's tables used to stay all zero.)"""
    import functools

    init_fns = {"t_b": functools.partial(torch.nn.init.normal_, mean=0.0, std=0.3), "t_d": _constant_half}
    res = run_multiprocess(_meta_built_tables, world, init_fns)
    for r in range(world):
        stock, herald = res[r]["stock"], res[r]["herald"]
        assert sorted(herald["tables"]) == ["t_a", "t_b", "t_c", "t_d"]
        for name, w in stock["tables"].items():
            assert torch.equal(herald["tables"][name], w), (r, name)
            assert float(w.std()) > 0 or name == "t_d", name
        assert herald["hot_ok"] is True
        assert torch.equal(herald["after"], stock["after"])
    t = res[0]["stock"]["tables"]
    assert float(t["t_a"].abs().max()) <= (1 / 101) ** 0.5 and float(t["t_b"].abs().max()) > (1 / 7) ** 0.5
    assert torch.equal(t["t_d"], torch.full((2, 4), 0.5))
