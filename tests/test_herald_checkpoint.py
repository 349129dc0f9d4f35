"""Herald checkpoints interoperate with stock TorchRec and unsharded models (2 ranks).

``ShardedHeraldEmbeddingBagCollection.state_dict()`` presents every table as a ShardedTensor in stock
ROW_WISE's layout (each rank its own block, hot rows' current values included: no table is gathered);
``load_state_dict`` takes that layout (a local copy per rank), full tensors, or other TorchRec
ShardedTensors. One 2-rank run (row-wise Adagrad,
so the optimizer state question is real) checks:

(i)   herald trained a few steps -> ``DMP.state_dict()`` -> a stock TABLE_WISE DMP and an unsharded
      ``DLRMTrain`` (plain ``load_state_dict``): identical weights, identical logits on a batch;
(ii)  stock ROW_WISE trained a few steps -> its ``DMP.state_dict()`` (ShardedTensors) -> a herald DMP:
      herald's state dict equals the stock one exactly, same logits and loss on a batch;
(iii) herald -> herald (same plan, and a plan with other hot sets and sync): exact round trip, same
      logits; a ``strict=False`` load of a subset of the tables loads those tables;
optimizer state: herald's fused optimizer exports each table's row-wise Adagrad ``momentum1`` as a
      ShardedTensor in stock ROW_WISE's layout under stock's keys, so it moves both ways between
      herald and stock ROW_WISE (:func:`test_optimizer_state_moves_between_herald_and_stock_row_wise`).

"Identical"/"exactly" is ``torch.equal``. ``DMP.load_state_dict`` gets a copy of the state dict:
TorchRec's DMP renames the dense (DDP) keys of the dict it is given in place.
"""

from __future__ import annotations

import functools
from typing import Any, Dict

import torch

from torchrec_herald.dist_utils import run_multiprocess

STEPS = 4
EBC = "model.sparse_arch.embedding_bag_collection.embedding_bags."


def _logits(dmp_or_model: Any, batch: Any) -> torch.Tensor:
    with torch.no_grad():
        loss, (_, logits, _) = dmp_or_model(batch)
    return torch.cat([logits.detach().flatten(), loss.detach().flatten()])


def _equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, bool]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return {k: torch.equal(a[k], b[k]) for k in b}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from herald_harness import build, full_momentum, full_state, gather_state, run_steps
    from torchrec_herald.model import build_dlrm_train

    cfg = dict(planner="herald", optimizer="rowwise_adagrad", via="apply", steps=STEPS, sync="dense")
    out: Dict[str, Any] = {}

    # (i) herald -> stock TABLE_WISE and unsharded
    h = build(world, cfg)
    probe = next(iter(h["data"].eval_batches(rank, world, h["batch_size"])))
    run_steps(h["dmp"], h["optimizer"], h["data"].train_batches(rank, world, h["batch_size"]))
    # the optimizer's state read first, before anything reads the model's (which writes the hot rows'
    # block copies): a checkpoint of the optimizer alone must hold the hot rows' state too
    early = {f"{k}/{kk}": vv.local_shards()[0].tensor.clone()
             for k, v in h["dmp"].fused_optimizer.state_dict()["state"].items() for kk, vv in v.items()}
    raw = h["dmp"].state_dict()
    out["herald_types"] = sorted({type(v).__name__ for k, v in raw.items() if k.startswith(EBC)})
    out["herald_local_rows"] = {t.name: raw[EBC + t.name + ".weight"].local_shards()[0].tensor.shape[0]
                                if raw[EBC + t.name + ".weight"].local_shards() else 0 for t in h["tables"]}
    out["herald_shapes_full"] = all(tuple(raw[EBC + t.name + ".weight"].shape) == (t.num_embeddings, 8)
                                    for t in h["tables"])
    sd = gather_state(raw)
    out["trained_moved"] = not all(torch.equal(sd[k], h["initial"][k]) for k in sd)
    out["herald_logits"] = _logits(h["dmp"], probe)
    fused = h["dmp"].fused_optimizer.state_dict()
    out["herald_fused_state"] = {k: sorted(v) for k, v in fused["state"].items()}
    out["herald_fused_keys"] = sorted(fused)

    tw = build(world, dict(cfg, planner="table_wise"))
    out["tw_load"] = tw["dmp"].load_state_dict(dict(sd))
    out["tw_equal"] = _equal(full_state(tw["dmp"]), sd)
    out["tw_logits"] = _logits(tw["dmp"], probe)

    model = build_dlrm_train(h["tables"], h["data"].num_dense, [16, 8], [16, 1], seed=123, device="cpu")
    out["plain_load"] = model.load_state_dict(dict(sd))
    out["plain_equal"] = _equal({k: v.detach() for k, v in model.state_dict().items()}, sd)
    out["plain_logits"] = _logits(model, probe)

    # (ii) stock ROW_WISE (ShardedTensors) -> herald
    rw = build(world, dict(cfg, planner="row_wise"))
    run_steps(rw["dmp"], rw["optimizer"], rw["data"].train_batches(rank, world, rw["batch_size"]))
    rw_raw = rw["dmp"].state_dict()
    out["rw_sharded"] = all(isinstance(rw_raw[EBC + t.name + ".weight"], ShardedTensor) for t in rw["tables"])
    rw_sd = gather_state(rw_raw)
    out["rw_local_rows"] = {t.name: rw_raw[EBC + t.name + ".weight"].local_shards()[0].tensor.shape[0]
                            if rw_raw[EBC + t.name + ".weight"].local_shards() else 0 for t in rw["tables"]}
    # herald's sharded state dict (no gathering) -> stock ROW_WISE (TorchRec copies shard for shard) and
    # -> a fresh herald DMP (each rank copies its own block, hot replicas refreshed)
    rw3 = build(world, dict(cfg, planner="row_wise"))
    out["rw3_load"] = rw3["dmp"].load_state_dict(dict(raw))
    out["rw3_equal"] = _equal(full_state(rw3["dmp"]), sd)
    h6 = build(world, cfg)
    out["h6_load"] = h6["dmp"].load_state_dict(dict(raw))
    out["h6_equal"] = _equal(full_state(h6["dmp"]), sd)
    out["h6_logits"] = _logits(h6["dmp"], probe)
    rw_fused = rw["dmp"].fused_optimizer.state_dict()
    out["rw_fused_state"] = {k: sorted(v) for k, v in rw_fused["state"].items()}

    def local(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        return {f"{k}/{kk}": vv.local_shards()[0].tensor.clone() for k, v in sd["state"].items()
                for kk, vv in v.items()}

    # herald and stock ROW_WISE trained on the same batches hold (numerically) the same Adagrad state
    out["opt_trained_diff"] = max((a - b).abs().max().item() for a, b in
                                  zip(local(fused).values(), local(rw_fused).values()))
    out["opt_trained_keys_equal"] = list(local(fused)) == list(local(rw_fused))
    out["opt_read_first_diff"] = max((a - b).abs().max().item() for a, b in
                                     zip(early.values(), local(rw_fused).values()))
    # stock ROW_WISE -> a fresh herald: state loaded exactly, hot replicas' state refreshed on every rank
    h_opt = build(world, cfg)
    h_opt["dmp"].fused_optimizer.load_state_dict(rw_fused)
    out["opt_stock_to_herald_equal"] = all(torch.equal(a, b) for a, b in
                                           zip(local(h_opt["dmp"].fused_optimizer.state_dict()).values(),
                                               local(rw_fused).values()))
    hot_module = [m for m in h_opt["dmp"].modules() if type(m).__name__ == "ShardedHeraldEmbeddingBagCollection"][0]
    out["opt_hot_state"] = hot_module.store.hot_state.clone()
    # each rank's hot replicas' state: the owners' rows of the state loaded (stock ROW_WISE's, gathered)
    owners = full_momentum(rw["dmp"])
    lay = hot_module.layout
    expected = torch.cat([owners[f"{t}.momentum1"][ids] for t, ids in zip(lay.tables, lay.hot_ids)])
    out["opt_hot_state_gap"] = float((hot_module.store.hot_state[:lay.num_hot] - expected).abs().max())
    out["opt_num_hot"] = lay.num_hot
    # herald -> a fresh stock ROW_WISE
    rw_opt = build(world, dict(cfg, planner="row_wise"))
    rw_opt["dmp"].fused_optimizer.load_state_dict(fused)
    out["opt_herald_to_stock_equal"] = all(torch.equal(a, b) for a, b in
                                           zip(local(rw_opt["dmp"].fused_optimizer.state_dict()).values(),
                                               local(fused).values()))
    h2 = build(world, cfg)
    out["h2_differs_before"] = not all(_equal(full_state(h2["dmp"]), rw_sd).values())
    out["h2_load"] = h2["dmp"].load_state_dict(dict(rw_raw))
    out["h2_equal"] = _equal(full_state(h2["dmp"]), rw_sd)
    out["rw_logits"] = _logits(rw["dmp"], probe)
    out["h2_logits"] = _logits(h2["dmp"], probe)

    # (iii) herald -> herald: same plan; other hot sets (min count 3) with sparse sync
    for name, extra in (("h3", {}), ("h4", dict(hot_min_count=3, sync="sparse"))):
        t = build(world, dict(cfg, **extra))
        out[f"{name}_hot_rows"] = sum(int(ps.hot.hot_ids.numel()) for ps in next(iter(t["plan"].plan.values())).values())
        out[f"{name}_load"] = t["dmp"].load_state_dict(dict(sd))
        out[f"{name}_equal"] = _equal(full_state(t["dmp"]), sd)
        out[f"{name}_logits"] = _logits(t["dmp"], probe)
    out["h_hot_rows"] = sum(int(ps.hot.hot_ids.numel()) for ps in next(iter(h["plan"].plan.values())).values())

    # strict=False with a subset of the tables: those tables are loaded, the others kept
    t5 = build(world, cfg)
    subset = {k: v for k, v in sd.items() if k.startswith(EBC) and ("t_cat_2." in k or "t_cat_11." in k)}
    out["partial_load"] = t5["dmp"].load_state_dict(dict(subset), strict=False)
    got = full_state(t5["dmp"])
    out["partial_loaded"] = all(torch.equal(got[k], sd[k]) for k in subset)
    out["partial_kept"] = all(torch.equal(got[k], t5["initial"][k]) for k in got if k not in subset)
    return out


@functools.lru_cache(maxsize=None)
def results() -> tuple:
    return tuple(run_multiprocess(_worker, 2, timeout_s=300))


def _no_bad_keys(load_result: Any) -> None:
    assert list(load_result.missing_keys) == [] and list(load_result.unexpected_keys) == []


def test_herald_checkpoint_loads_into_stock_and_unsharded() -> None:
    for r in results():
        assert r["trained_moved"]
        assert r["herald_types"] == ["ShardedTensor"] and r["herald_shapes_full"]  # global shapes, local blocks
        assert r["herald_local_rows"] == r["rw_local_rows"]  # each rank holds exactly its ROW_WISE block
        _no_bad_keys(r["tw_load"])
        _no_bad_keys(r["plain_load"])
        assert all(r["tw_equal"].values()), [k for k, v in r["tw_equal"].items() if not v]
        assert all(r["plain_equal"].values()), [k for k, v in r["plain_equal"].items() if not v]
        assert torch.equal(r["tw_logits"], r["herald_logits"])
        assert torch.equal(r["plain_logits"], r["herald_logits"])


def test_stock_row_wise_checkpoint_loads_into_herald() -> None:
    for r in results():
        assert r["rw_sharded"] and r["h2_differs_before"]
        _no_bad_keys(r["h2_load"])
        assert all(r["h2_equal"].values()), [k for k, v in r["h2_equal"].items() if not v]
        assert torch.equal(r["h2_logits"], r["rw_logits"])  # logits and loss


def test_sharded_herald_state_loads_without_gathering() -> None:
    for r in results():
        for name in ("rw3", "h6"):
            _no_bad_keys(r[f"{name}_load"])
            assert all(r[f"{name}_equal"].values()), (name, [k for k, v in r[f"{name}_equal"].items() if not v])
        assert torch.equal(r["h6_logits"], r["herald_logits"])


def test_herald_round_trip() -> None:
    for r in results():
        assert r["h3_hot_rows"] == r["h_hot_rows"] > r["h4_hot_rows"] > 0  # h4: other hot sets
        for name in ("h3", "h4"):
            _no_bad_keys(r[f"{name}_load"])
            assert all(r[f"{name}_equal"].values()), (name, [k for k, v in r[f"{name}_equal"].items() if not v])
            assert torch.equal(r[f"{name}_logits"], r["herald_logits"]), name


def test_partial_non_strict_load() -> None:
    for r in results():
        assert len(r["partial_load"].missing_keys) > 0  # reported, as nn.Module does
        assert r["partial_loaded"], "strict=False load of 2 tables did not load them"
        assert r["partial_kept"]


def test_optimizer_state_moves_between_herald_and_stock_row_wise() -> None:
    """Herald exports one ``momentum1`` per table under stock's keys (ROW_WISE layout): after the same
    training it equals stock ROW_WISE's state, and it loads both ways exactly; loading refreshes the
    hot replicas' state to the owners' values, identically on every rank."""
    res = results()
    for r in res:
        assert r["herald_fused_keys"] == ["state"]
        assert r["herald_fused_state"] == r["rw_fused_state"]
        assert len(r["rw_fused_state"]) == 26
        assert r["rw_fused_state"][EBC + "t_cat_0.weight"] == ["t_cat_0.momentum1"]
        assert r["opt_trained_keys_equal"]
        assert r["opt_trained_diff"] < 1e-8
        assert r["opt_read_first_diff"] < 1e-8  # read before the model's state: the hot rows' too
        assert r["opt_stock_to_herald_equal"] and r["opt_herald_to_stock_equal"]
    assert torch.equal(res[0]["opt_hot_state"], res[1]["opt_hot_state"])
    assert res[0]["opt_hot_state"].sum() > 0
    for r in res:  # each rank's hot replicas' state is the owners' (stock ROW_WISE's state at the hot ids)
        assert r["opt_num_hot"] > 0 and r["opt_hot_state_gap"] == 0.0
