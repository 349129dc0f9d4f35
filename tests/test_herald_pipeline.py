"""HeraldTrainPipeline (torchrec_herald/pipeline/train_pipeline.py) trains exactly the model stock TorchRec
trains, and behaves as a train pipeline should.

Exactness: the herald EBC driven by the pipeline (look-ahead window, location-aware sample allocation,
worker caches with the lazy plan executed by ``PlanExecutor``) against stock TorchRec TABLE_WISE
(``herald_harness``, plain loop) on the same global batches for ``STEPS`` steps:

* per step, the loss **averaged over ranks** (the allocator moves samples between ranks, so a rank's
  local loss is over other samples than stock's; the global batch's set of samples is the same):
  ``|h - s| / |s| <= RTOL``;
* every final ``DMP.state_dict()`` tensor (embedding tables gathered to full tensors after training; the
  pipeline flushes its caches at ``StopIteration``): ``max|h - s| / max|s| <= RTOL``; herald's tables are
  the same on every rank;
* the configured paths really ran (TrafficMeter tags, per rank): lazy sync moves rows
  (``herald_pull``, ``herald_reduce``, ``herald_update_push``) and never looks a row up remotely (no
  ``herald_pooled``, no ``herald_hot_sync``); the greedy allocator exchanges samples (``herald_samples``),
  the identity allocator does not; eager sync uses herald's own per-step path (``herald_pooled``,
  ``herald_hot_sync``) and no plan transfers. The gradients sent (``herald_reduce`` vectors summed over
  ranks) are exactly the plan's ``reduce`` count.

====================  ===  ===============  ============  ====  ========================================
case                  W    optimizer        set via       pool  pipelines (all vs stock TABLE_WISE)
====================  ===  ===============  ============  ====  ========================================
w2_sgd                2    EXACT_SGD        apply_in_bwd  SUM   greedy+lazy (K=5); identity+lazy;
                                                                greedy+eager; greedy+lazy K=1, 1 % cache
w2_adagrad            2    ROWWISE_ADAGRAD  fused_params  SUM   greedy+lazy (K=5)
w3_sgd_mean_multihot  3    EXACT_SGD        fused_params  MEAN  greedy+lazy (K=5), 0-3 ids per bag
w4_adagrad            4    ROWWISE_ADAGRAD  apply_in_bwd  SUM   greedy+lazy (K=5)
====================  ===  ===============  ============  ====  ========================================

K=1 places the look-ahead pushes before the next step's reads (``push_before_read``) and the 1 % cache
forces dirty evictions (``miss_push``). Runs of one world size share a process group (``train_many``
style, cached with ``functools.lru_cache``).

Behaviour (one 2-rank process group, :func:`_behaviour`): the last partial window is trained; a window
larger than the data, bad constructor arguments and out-of-range ids (in one rank's batch) are
ValueErrors on every rank (after a bad id mid-run a flush leaves exactly the steps trained so far); a
rank whose batch has no ids trains exactly; the greedy allocation keeps ``B`` samples per rank and moves
whole samples (dense row, label, every bag) so that the ranks together hold exactly the global batch; a flush in the
middle of a run leaves herald's stock layout (state equal to stock's at that step, equal on every rank, a
second flush moves nothing) and training goes on exactly; after the run the checkpoint loads into stock
TABLE_WISE with identical weights and logits, and the detached model keeps training exactly with
herald's own path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

from herald_harness import MappedData, error_of, weight_rtol
from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.pipeline.input_allocator import greedy_assign

STEPS = 50
RTOL = 1e-5

#: case -> (world size, common harness cfg, pipeline runs)
CASES: Dict[str, Tuple[int, Dict[str, Any], Tuple[str, ...]]] = {
    "w2_sgd": (2, dict(optimizer="sgd", via="apply", pooling="SUM"), ("greedy_lazy", "identity_lazy", "greedy_eager",
                                                                       "greedy_lazy_k1_small_cache", "by_home_lazy",
                                                                       "by_home_serial")),
    "w2_adagrad": (2, dict(optimizer="rowwise_adagrad", via="fused_params", pooling="SUM"), ("greedy_lazy",)),
    # the path of ids and rows on a GPU: the id split and the row store's gathers and scatters by torch ops
    "w2_adagrad_gpu_path": (2, dict(optimizer="rowwise_adagrad", via="fused_params", pooling="SUM", torch_ids=True),
                            ("greedy_lazy", "by_home_lazy")),
    "w3_sgd_mean_multihot": (3, dict(optimizer="sgd", via="fused_params", pooling="MEAN", multi_hot=True),
                             ("greedy_lazy", "by_home_lazy_small_cache", "defaults")),
    "w3_adagrad": (3, dict(optimizer="rowwise_adagrad", via="fused_params", pooling="SUM"), ("defaults",)),
    "w4_adagrad": (4, dict(optimizer="rowwise_adagrad", via="apply", pooling="SUM"), ("greedy_lazy", "by_home_lazy",
                                                                                     "defaults")),
    "w4_sgd": (4, dict(optimizer="sgd", via="apply", pooling="SUM"), ("defaults",)),
}
#: pipeline run -> HeraldTrainPipeline kwargs
PIPELINES: Dict[str, Dict[str, Any]] = {
    # the defaults: window 5, lazy, lru, 5 % cache; planning=auto: global at W=2 (on these per-rank batches the
    # greedy allocator moves a sample only where one lookup made local pays for it), by home with the compiled
    # scheduler from W=3 (samples stay where loaded)
    "defaults": {},
    # global planning (the greedy allocator needs every rank's view); move_penalty=0: any gain moves a
    # sample, so the sample exchange runs (the default prices a move in bytes and moves few samples here);
    # these per-rank batches are scheduled ahead in a thread, their exchanges on a group of their own
    "greedy_lazy": dict(allocator="greedy", move_penalty=0),
    "identity_lazy": dict(allocator="identity"),
    "greedy_eager": dict(allocator="greedy", sync="eager", move_penalty=0),
    "greedy_lazy_k1_small_cache": dict(allocator="greedy", window=1, cache_fraction=0.01, move_penalty=0),
    # planning by home (each rank plans its own rows; samples stay where loaded): by default it runs ahead
    # in a thread, its exchanges on a process group of their own; serial: on the step's critical path
    # (scheduling on: the probe of scheduling=auto may turn it off, and these runs pin down its paths)
    "by_home_lazy": dict(allocator="identity", planning="by_home", scheduling="on"),
    "by_home_serial": dict(allocator="identity", planning="by_home", run_ahead=False, scheduling="on"),
    "by_home_lazy_small_cache": dict(allocator="identity", planning="by_home", cache_fraction=0.01, scheduling="on"),
}


def _train_runs(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``herald_harness.train`` per cfg, plus the pipeline's SchedulerStats for herald pipeline runs."""
    from herald_harness import run_steps, train

    out = []
    for cfg in cfgs:
        res = train(rank, world, cfg)
        if isinstance(cfg.get("pipeline"), dict):
            pipe = run_steps.last_pipeline  # type: ignore[attr-defined]
            res["stats"] = pipe.stats
            res["resolved"] = dict(planning=pipe.config.planning, allocator=pipe.allocator,
                                   impl=pipe.planner.impl)
            res["scheduling"] = pipe.scheduling_report()
        out.append(res)
    return out


@functools.lru_cache(maxsize=None)
def runs(world: int) -> Dict[Tuple[str, str], List[Dict[str, Any]]]:
    """(case, run) -> per-rank results, for every case of this world size (run "stock": TABLE_WISE),
    all in one process group."""
    names, cfgs = [], []
    for case, (w, common, pipes) in CASES.items():
        if w != world:
            continue
        names.append((case, "stock"))
        cfgs.append(dict(common, steps=STEPS, planner="table_wise", pipeline="plain"))
        for p in pipes:
            names.append((case, p))
            cfgs.append(dict(common, steps=STEPS, planner="herald", pipeline=dict(PIPELINES[p])))
    per_rank = run_multiprocess(_train_runs, world, cfgs, timeout_s=300)
    return {n: [per_rank[r][i] for r in range(world)] for i, n in enumerate(names)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max(max|b|, 1e-12): relative difference of ``a`` to the reference ``b``."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def mean_losses(per_rank: List[Dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).mean(0)


def _bytes(tags: Dict[str, Dict[str, float]], tag: str) -> float:
    return tags.get(tag, {}).get("bytes", 0)


EXACT_RUNS = [(case, p) for case, (_, _, pipes) in CASES.items() for p in pipes]


def test_planning_by_home_runs_ahead_with_the_serial_plans() -> None:
    """Planning by home ahead of the step (a thread, its own process group) and on the critical path give
    the same plans and bit-identical training."""
    r = runs(2)
    ahead, serial = r[("w2_sgd", "by_home_lazy")], r[("w2_sgd", "by_home_serial")]
    for a, s in zip(ahead, serial):
        assert a["losses"] == s["losses"] and a["stats"].counters == s["stats"].counters
        assert all(torch.equal(a["state"][k], v) for k, v in s["state"].items())
        assert a["stats"].ahead_s > 0 and s["stats"].ahead_s == 0  # the first ran ahead, the second did not


@pytest.mark.parametrize("case,pipe", EXACT_RUNS, ids=[f"{c}-{p}" for c, p in EXACT_RUNS])
def test_herald_pipeline_matches_stock_table_wise(case: str, pipe: str) -> None:
    world = CASES[case][0]
    r = runs(world)
    herald, stock = r[(case, pipe)], r[(case, "stock")]
    for res in herald + stock:
        assert len(res["losses"]) == STEPS
    h_loss, s_loss = mean_losses(herald), mean_losses(stock)
    loss_rel = float(((h_loss - s_loss).abs() / s_loss.abs().clamp(min=1e-12)).max())
    assert loss_rel <= RTOL, (case, pipe, loss_rel)
    for rank in range(world):
        h, s = herald[rank]["state"], stock[rank]["state"]
        assert set(h) == set(s) and sum(".embedding_bags." in k for k in s) == 26
        tol = weight_rtol(CASES[case][1]["optimizer"])
        bad = {k: rel(h[k], s[k]) for k in s if not rel(h[k], s[k]) <= tol}
        assert not bad, (case, pipe, rank, bad)
        for k, v in h.items():  # herald's copies agree: every rank presents the same model
            assert torch.equal(v, herald[0]["state"][k]), (case, pipe, rank, k)
        gap = herald[rank]["hot_replica_gap"]  # and each rank's own hot replicas hold its rows
        assert gap == 0.0, (case, pipe, rank, gap)
    # training moved the weights
    init = stock[0]["initial"]
    assert all(not torch.equal(stock[0]["state"][k], init[k]) for k in init)


@pytest.mark.parametrize("case,pipe", EXACT_RUNS, ids=[f"{c}-{p}" for c, p in EXACT_RUNS])
def test_herald_pipeline_ran_its_configured_paths(case: str, pipe: str) -> None:
    world = CASES[case][0]
    herald = runs(world)[(case, pipe)]
    kwargs = PIPELINES[pipe]
    lazy = kwargs.get("sync", "lazy") == "lazy"
    resolved = herald[0]["resolved"]
    greedy = resolved["allocator"] == "greedy"
    stats = herald[0]["stats"]
    assert stats.steps == STEPS
    by_home = resolved["planning"] == "by_home"
    if pipe == "defaults":  # planning=auto: by home, compiled, samples where loaded (W >= 3 here)
        assert world >= 3 and resolved == dict(planning="by_home", allocator="identity", impl="compiled"), resolved
        # scheduling=auto: the probe timed both modes and every rank kept the same one (which one depends on
        # the timings of these shared cores; the by_home_* runs pin down the paths with scheduling on)
        reports = [res["scheduling"] for res in herald]
        assert reports[0]["setting"] == "auto" and reports[0]["decided"] is True
        assert all(r == reports[0] for r in reports)
        assert all(res["stats"].steps == STEPS for res in herald)
        return
    elif by_home:
        assert resolved["allocator"] == "identity" and resolved["impl"] == "compiled", resolved
    else:
        # every rank plans globally, compiled (the tensor planners are the references)
        assert resolved["planning"] == "global" and resolved["impl"] == "compiled", resolved
    total = herald[0]["stats"].counters
    for res in herald[1:]:
        total = total + res["stats"].counters
    for rank, res in enumerate(herald):
        tags = res["tags"]
        if by_home:  # each rank counts the rows it is home to; every rank's own step ran
            assert res["stats"].steps == STEPS and _bytes(tags, "herald_schedule_meta") > 0, rank
        else:
            assert res["stats"].counters == stats.counters, rank  # every rank ran the same plans
        if lazy:
            for tag in ("herald_pull", "herald_reduce", "herald_update_push"):
                assert _bytes(tags, tag) > 0, (rank, tag, tags)
            # all lookups local: no remote pooling, no per-step hot-row sync
            assert "herald_pooled" not in tags and "herald_pooled_grad" not in tags, tags
            assert "herald_hot_sync" not in tags, tags
        else:
            assert _bytes(tags, "herald_pooled") > 0 and _bytes(tags, "herald_hot_sync") > 0, tags
            for tag in ("herald_pull", "herald_reduce", "herald_update_push"):
                assert tag not in tags, tags
        assert (_bytes(tags, "herald_samples") > 0) == greedy, (rank, tags)
    assert (stats.moved_samples > 0) == greedy
    if lazy:
        c = total if by_home else stats.counters
        assert min(c.miss_pull, c.update_pull, c.reduce, c.update_push) > 0, c
        assert c.reads > 0 and 0 < c.hits < c.reads
        # every planned gradient message was sent, and nothing else under that tag
        assert sum(res["tags"]["herald_reduce"]["embedding_vectors"] for res in herald) == c.reduce
        # pulls/pushes: the plan's, plus the final flush's; run ahead, a step's pushes and the next step's
        # pulls may travel in one all-to-all (herald_push_pull)
        def rows(*tags: str) -> float:
            return sum(res["tags"].get(t, {}).get("embedding_vectors", 0.0) for res in herald for t in tags)

        assert rows("herald_pull", "herald_update_push", "herald_push_pull") >= \
            c.miss_pull + c.update_pull + c.update_push + c.miss_push
        if not rows("herald_push_pull"):
            assert rows("herald_pull") >= c.miss_pull + c.update_pull
            assert rows("herald_update_push") >= c.update_push + c.miss_push
        if pipe in ("greedy_lazy_k1_small_cache", "by_home_lazy_small_cache"):
            assert c.miss_push > 0, c  # dirty evictions executed
    else:
        assert stats.counters.reads == 0


def test_herald_scheduling_at_one_rank_trains_as_stock_and_issues_no_collective() -> None:
    """At one rank herald scheduling (global and by home, the torch ops' path of ids and rows on a GPU) trains
    stock TABLE_WISE's model, and none of its exchanges (pulls, reduces, pushes, sample moves, the schedule's
    metadata) issues a collective: nothing travels, and each is skipped as TorchRec skips its input dist's."""
    common = dict(optimizer="rowwise_adagrad", via="fused_params", pooling="SUM", torch_ids=True, steps=STEPS)
    cfgs = [dict(common, planner="table_wise", pipeline="plain")] + [
        dict(common, planner="herald", pipeline=dict(PIPELINES[p])) for p in ("greedy_lazy", "by_home_lazy")]
    stock, *herald = run_multiprocess(_train_runs, 1, cfgs, timeout_s=300)[0]
    for res in herald:
        assert res["stats"].steps == STEPS and res["stats"].counters.reads > 0
        assert res["losses"] == pytest.approx(stock["losses"], rel=RTOL)
        bad = {k: rel(v, stock["state"][k]) for k, v in res["state"].items()
               if not rel(v, stock["state"][k]) <= weight_rtol("rowwise_adagrad")}
        assert not bad, bad
        assert not [t for t in res["tags"] if t.startswith("herald_") or t == "dense_allreduce"], res["tags"]
    assert any(not torch.equal(stock["state"][k], v) for k, v in stock["initial"].items())


# ------------------------------------------------------------------------------------------ behaviour

BAD_FEATURE = "cat_3"  # table t_cat_3: 2203 rows at scale 0.001
BAD_STEP = 2  # the bad id is in rank 1's third batch (prepared while filling the first window)


def TaggedData(data: Any) -> Any:  # noqa: N802
    """``data`` whose dense feature 0 carries each sample's global index (step · G + rank · B + i),
    exact in float32: identifies a sample after the allocator moved it."""
    from torchrec.datasets.utils import Batch

    def tag(step: int, rank: int, world: int, batch_size: int, b: Any) -> Any:
        dense = b.dense_features.clone()
        dense[:, 0] = torch.arange(batch_size, dtype=dense.dtype) + (step * world + rank) * batch_size
        return Batch(dense_features=dense, sparse_features=b.sparse_features, labels=b.labels)

    return MappedData(data, tag)


def BadIdData(data: Any, value: int) -> Any:  # noqa: N802
    """``data`` with one id of ``BAD_FEATURE`` replaced by ``value`` in rank 1's batch ``BAD_STEP``."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def corrupt(step: int, rank: int, world: int, batch_size: int, b: Any) -> Any:
        if rank != 1 or step != BAD_STEP:
            return b
        kjt = b.sparse_features
        f = kjt.keys().index(BAD_FEATURE)
        values = kjt.values().clone()
        values[sum(kjt.length_per_key()[:f]) + 5] = value
        return Batch(b.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()),
                     b.labels)

    return MappedData(data, corrupt)


def EmptyBagsData(data: Any) -> Any:  # noqa: N802
    """``data`` whose rank-1 batches 1 and 2 have no ids at all (every bag empty)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def empty(step: int, rank: int, world: int, batch_size: int, b: Any) -> Any:
        if rank != 1 or step not in (1, 2):
            return b
        kjt = b.sparse_features
        return Batch(b.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[:0],
                                                         lengths=torch.zeros_like(kjt.lengths())), b.labels)

    return MappedData(data, empty)


def _samples(batch: Any) -> List[Tuple]:
    """Per sample: (tag, dense row, label, ids of every bag), hashable and exact."""
    kjt = batch.sparse_features
    B = kjt.stride()
    bags = [kjt[k].to_dense() for k in kjt.keys()]  # per feature: list of B id tensors
    return [(int(batch.dense_features[i, 0]), tuple(batch.dense_features[i].tolist()), float(batch.labels[i]),
             tuple(tuple(bags[f][i].tolist()) for f in range(len(bags)))) for i in range(B)]


_error = error_of


def test_a_sample_moves_only_where_its_local_lookups_save_more_bytes_than_it_sends() -> None:
    """``move_penalty=null`` (the default) on per-rank batches: each batch's penalty is the least number of
    local lookups (``8 + 8D`` bytes each) whose bytes exceed one sample's on the exchange, every moved
    sample gains at least that many, and a zero penalty would have moved samples that do not pay."""
    res = behaviour()
    B = res[0]["B"]
    lookup = 8 + 8 * res[0]["embedding_dim"]
    assert [d["priced"] for d in res[0]["priced"]] == [d["priced"] for d in res[1]["priced"]]
    unpaid_at_zero = 0
    for r in res:
        assert len(r["priced"]) == 3
        for d, sample in zip(r["priced"], r["sample_bytes"]):
            assert d["priced"] == int(sample // lookup) + 1 >= 2, (d["priced"], sample, lookup)
            scores, rank_of = d["scores"], d["rank_of"]
            home = torch.arange(scores.shape[0]) // B
            gain = scores.gather(1, rank_of[:, None]).flatten() - scores.gather(1, home[:, None]).flatten()
            moved = rank_of != home
            assert bool((gain[moved] * lookup > sample).all()), (gain[moved], sample)
            assert torch.equal(rank_of, greedy_assign(scores, d["step"], "rotate", d["priced"]))
            free = greedy_assign(scores, d["step"], "rotate", 0)
            free_gain = scores.gather(1, free[:, None]).flatten() - scores.gather(1, home[:, None]).flatten()
            unpaid_at_zero += int(((free != home) & (free_gain * lookup <= sample)).sum())
        assert r["priced_report"] == {"set": None, "priced": r["priced"][-1]["priced"]}
        assert r["priced_moved"] == [int((d["rank_of"] != torch.arange(2 * B) // B).sum()) for d in r["priced"]]
    assert unpaid_at_zero > 0  # the rule changed the assignment: penalty 0 moves samples that cost more than they save


def test_auto_allocator_on_per_rank_batches_moves_samples_only_where_one_lookup_pays_for_one() -> None:
    """``allocator=auto`` where each rank loads its own batch: the greedy allocator, moving samples only in
    a batch priced at a penalty of 1 (one remote lookup's ``8 + 8D`` bytes exceed the sample's). At this
    harness's dim 8 the price is higher: nothing moves, and after the first batch no scores are gathered.
    With a lookup priced above any sample every batch is scored and samples move."""
    for r in behaviour():
        auto, pays = r["auto"], r["auto_one_lookup_pays"]
        assert auto["allocator"] == pays["allocator"] == \
            "GreedyLocalityAllocator(tie_break='rotate', move_penalty=None, max_priced=1)"
        assert auto["moved"] == [0, 0, 0] and auto["scored"] == 1, auto
        assert auto["report"]["max_priced"] == 1 and auto["report"]["priced"] >= 2, auto
        assert pays["scored"] == 3 and sum(pays["moved"]) > 0, pays
        assert pays["report"] == {"set": None, "priced": 1, "max_priced": 1}


def _drain(pipe: Any, it: Iterator[Any]) -> List[float]:
    losses = []
    while True:
        try:
            losses.append(pipe.progress(it)[0].item())
        except StopIteration:
            return losses


def _plain_steps(dmp: Any, optimizer: Any, it: Iterator[Any], n: int) -> List[float]:
    losses = []
    for _, batch in zip(range(n), it):
        loss, _ = dmp(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _behaviour(rank: int, world: int) -> Dict[str, Any]:
    from herald_harness import MultiHotData, build, full_state, gather_state, make_data, run_steps
    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.traffic import TrafficMeter

    cpu = torch.device("cpu")
    out: Dict[str, Any] = {}

    # -- allocation moves whole samples; the last partial window is trained (7 batches, window 5)
    data = TaggedData(MultiHotData(make_data({"steps": 7})))
    h = build(world, dict(planner="herald", steps=7, multi_hot=True), data=data)
    B = out["B"] = h["batch_size"]
    pipe = HeraldTrainPipeline(h["dmp"], h["optimizer"], cpu, window=5, allocator="greedy", move_penalty=0)
    it = data.train_batches(rank, world, B)
    pipe.fill(it)
    out["queued"] = [_samples(e.batch) for e in pipe._queue]
    out["moved"] = [e.moved for e in pipe._queue]
    shards = [data.train_batches(r, world, B) for r in range(world)]
    out["global"] = [sorted(s for b in step for s in _samples(b)) for _, step in zip(range(5), zip(*shards))]
    out["partial_losses"] = _drain(pipe, it)
    out["partial_steps"] = pipe.stats.steps
    ref = build(world, dict(planner="table_wise", steps=7, multi_hot=True), data=data)  # stock on the same batches
    out["partial_stock_losses"] = run_steps(ref["dmp"], ref["optimizer"], data.train_batches(rank, world, B))

    # -- the default move penalty is priced per batch: record what the allocator was given and did
    pipe = HeraldTrainPipeline(h["dmp"], h["optimizer"], cpu, window=3, allocator="greedy")
    seen: List[Dict[str, Any]] = []
    assign = pipe.env.allocator.assign_scores

    def recording(scores: torch.Tensor, step: int, priced: int = 0) -> torch.Tensor:
        rank_of = assign(scores, step, priced)
        seen.append(dict(scores=scores.clone(), step=step, priced=priced, rank_of=rank_of.clone()))
        return rank_of

    pipe.env.allocator.assign_scores = recording
    pipe.fill(data.train_batches(rank, world, B))
    out["priced"] = seen
    out["priced_report"] = pipe.move_penalty_report()
    out["priced_moved"] = [e.moved for e in pipe._queue]
    out["embedding_dim"] = pipe.ebc.embedding_dim
    out["sample_bytes"] = [4 * (step[0].dense_features.shape[1] + 1 + len(step[0].sparse_features.keys()))
                           + 4 * sum(b.sparse_features.values().numel() for b in step) / (world * B)
                           for _, step in zip(range(3), zip(*[data.train_batches(r, world, B) for r in range(world)]))]

    # -- allocator=auto on per-rank batches: samples move only in batches where one lookup made local saves
    # more bytes than the sample sends; the scores are gathered only while moves may pay
    from unittest import mock

    for name, lookup_bytes in (("auto", None), ("auto_one_lookup_pays", 10**6)):
        patch = (mock.patch("torchrec_herald.pipeline.stages.allocate.cold_lookup_bytes", lambda dim: lookup_bytes)
                 if lookup_bytes else contextlib.nullcontext())
        with patch:
            pipe = HeraldTrainPipeline(h["dmp"], h["optimizer"], cpu, window=3)
            scored = []
            local_scores = pipe.env.planner.local_scores
            pipe.env.planner.local_scores = lambda *a: scored.append(1) or local_scores(*a)
            pipe.fill(data.train_batches(rank, world, B))
        out[name] = dict(moved=[e.moved for e in pipe._queue], scored=len(scored), report=pipe.move_penalty_report(),
                         allocator=repr(pipe.input_allocator))

    # -- a window larger than the data; a window as large as the data trains it all
    h = build(world, dict(planner="herald", steps=3))
    dmp, opt, data = h["dmp"], h["optimizer"], h["data"]
    pipe = HeraldTrainPipeline(dmp, opt, cpu, window=5)
    out["window_larger_losses"] = _drain(pipe, data.train_batches(rank, world, B))
    pipe = HeraldTrainPipeline(dmp, opt, cpu, window=3)
    out["window_equal_losses"] = _drain(pipe, data.train_batches(rank, world, B))

    # -- bad constructor arguments (no collective runs before they are raised)
    for name, kw in {"fraction_0": dict(cache_fraction=0.0), "fraction_1.5": dict(cache_fraction=1.5),
                     "allocator": dict(allocator="nope"), "sync": dict(sync="nope"), "cache": dict(cache="belady"),
                     "window_0": dict(window=0), "move_penalty": dict(move_penalty=-1)}.items():
        out[f"ctor_{name}"] = _error(lambda: HeraldTrainPipeline(dmp, opt, cpu, **kw))

    # -- an out-of-range id in rank 1's batch: every rank raises, naming the feature and the table;
    # window 3: while filling the first window (nothing trained); window 1: in the third step, after two
    # planned steps, and a flush then leaves the state of those steps
    n = dict(zip(data.feature_names, data.num_embeddings))[BAD_FEATURE]
    out["num_embeddings"] = n
    for name, value, window in (("too_large", n, 3), ("negative", -1, 1)):
        bad = BadIdData(data, value)
        pipe = HeraldTrainPipeline(dmp, opt, cpu, window=window)
        out[f"bad_{name}"] = _error(lambda: _drain(pipe, bad.train_batches(rank, world, B)))
        out[f"bad_{name}_steps"] = pipe.stats.steps
    pipe.flush()
    out["after_bad_state"] = full_state(dmp)
    ref = build(world, dict(planner="table_wise", steps=3))
    for _ in range(2):  # (the loader shorter than the window, then the window of the loader's length)
        _plain_steps(ref["dmp"], ref["optimizer"], ref["data"].train_batches(rank, world, B), 3)
    _plain_steps(ref["dmp"], ref["optimizer"], ref["data"].train_batches(rank, world, B), BAD_STEP)
    out["after_bad_stock_state"] = full_state(ref["dmp"])

    # -- a rank whose batch has no ids at all (identity allocation: it stays empty in plan mode)
    data = EmptyBagsData(make_data({"steps": 6}))
    empty = {}
    for planner, pipeline in (("herald", dict(allocator="identity")), ("table_wise", "plain")):
        b = build(world, dict(planner=planner, steps=6), data=data)
        empty[planner] = (run_steps(b["dmp"], b["optimizer"], data.train_batches(rank, world, B), pipeline),
                         full_state(b["dmp"]))
    out["empty_rank"] = empty

    # -- a flush in the middle of a run; the checkpoint after the run; training on after detach
    cfg = dict(steps=12, optimizer="rowwise_adagrad")
    hs, tw = build(world, dict(cfg, planner="herald")), build(world, dict(cfg, planner="table_wise"))
    out["not_herald"] = _error(lambda: HeraldTrainPipeline(tw["dmp"], tw["optimizer"], cpu))
    stock_it = tw["data"].train_batches(rank, world, B)
    out["stock_losses"] = _plain_steps(tw["dmp"], tw["optimizer"], stock_it, 3)
    out["stock_state_3"] = full_state(tw["dmp"])
    out["stock_losses"] += _plain_steps(tw["dmp"], tw["optimizer"], stock_it, 9)
    out["stock_state_12"] = full_state(tw["dmp"])

    pipe = HeraldTrainPipeline(hs["dmp"], hs["optimizer"], cpu, window=5)
    it = hs["data"].train_batches(rank, world, B)
    out["herald_losses"] = [pipe.progress(it)[0].item() for _ in range(3)]
    with TrafficMeter(embedding_dim=8) as meter:
        pipe.flush()
    out["first_flush_traffic"] = meter.tag_summary()
    with TrafficMeter(embedding_dim=8) as meter:
        pipe.flush()
    out["second_flush_traffic"] = meter.summary()
    # each rank's own view after a flush: the gathered state and its hot replicas
    out["raw_state_3"] = dict(gather_state(hs["dmp"].state_dict()), hot=pipe.ebc.hot_values())
    out["herald_state_3"] = full_state(hs["dmp"])
    out["herald_losses"] += _drain(pipe, it)
    out["herald_state_12"] = full_state(hs["dmp"])
    model = pipe.detach()
    with TrafficMeter(embedding_dim=8) as meter:
        pipe.detach()
    out["second_detach_traffic"] = meter.summary()
    out["raw_state_12"] = dict(gather_state(model.state_dict()), hot=pipe.ebc.hot_values())

    # the checkpoint loads into stock TABLE_WISE: identical weights and logits
    sd = full_state(model)
    loaded = build(world, dict(cfg, planner="table_wise"))
    loaded["dmp"].load_state_dict(dict(sd))
    out["loaded_equal"] = {k: torch.equal(v, sd[k]) for k, v in full_state(loaded["dmp"]).items()}
    probe = next(iter(hs["data"].eval_batches(rank, world, B)))
    with torch.no_grad():
        out["herald_logits"] = model(probe)[1][1].detach().flatten()
        out["loaded_logits"] = loaded["dmp"](probe)[1][1].detach().flatten()

    # the detached model trains on with herald's own per-step path, exactly as stock does
    more = lambda d: d.train_batches(rank, world, B)  # noqa: E731 - a second pass over the data
    out["herald_more"] = _plain_steps(model, hs["optimizer"], more(hs["data"]), 3)
    out["stock_more"] = _plain_steps(tw["dmp"], tw["optimizer"], more(tw["data"]), 3)
    out["herald_state_more"] = full_state(model)
    out["stock_state_more"] = full_state(tw["dmp"])
    return out


@functools.lru_cache(maxsize=None)
def behaviour() -> List[Dict[str, Any]]:
    return run_multiprocess(_behaviour, 2, timeout_s=300)


def test_last_partial_window_is_trained() -> None:
    """7 batches through a window of 5: the last two train, and every step's loss is stock TABLE_WISE's on the same
    global batches (the mean over ranks: the allocator moves samples between them)."""
    res = behaviour()
    for r in res:
        assert r["partial_steps"] == 7 and len(r["partial_losses"]) == len(r["partial_stock_losses"]) == 7
    h = torch.tensor([r["partial_losses"] for r in res], dtype=torch.float64).mean(0)
    s = torch.tensor([r["partial_stock_losses"] for r in res], dtype=torch.float64).mean(0)
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL


def test_greedy_allocation_keeps_batch_size_and_moves_whole_samples() -> None:
    res = behaviour()
    B = res[0]["B"]
    assert len(res[0]["queued"]) == 5
    for step in range(5):
        for r in res:
            assert len(r["queued"][step]) == B, (step, r["queued"][step])
        got = sorted(s for r in res for s in r["queued"][step])
        assert got == res[0]["global"][step], step  # every sample once, with its own dense row, label, bags
        assert len({s[0] for s in got}) == 2 * B
    assert sum(res[0]["moved"]) > 0  # the allocator did move samples
    assert res[0]["moved"] == res[1]["moved"]


def test_a_loader_shorter_than_the_window_trains_every_batch_on_every_rank() -> None:
    """As TorchRec's pipelines do (it was refused; tests/test_pipeline_like_torchrec.py compares the losses with
    stock's)."""
    for r in behaviour():
        assert len(r["window_larger_losses"]) == 3 and len(r["window_equal_losses"]) == 3


@pytest.mark.parametrize("name,expected", [
    ("fraction_0", "pipeline.cache_fraction=0: a cache must hold at least one row"),
    ("fraction_1.5", "pipeline.cache_fraction=1.5: a cache must hold at least one row"),
    ("allocator", "unknown pipeline.allocator 'nope'"),
    ("sync", "unknown pipeline.sync 'nope'"),
    ("cache", "unknown pipeline.cache 'belady'"),
    ("window_0", "pipeline.window must be >= 1"),
    ("move_penalty", "pipeline.move_penalty must be null (priced per batch) or an integer >= 0"),
])
def test_bad_pipeline_arguments_are_value_errors(name: str, expected: str) -> None:
    for r in behaviour():
        msg = r[f"ctor_{name}"]
        assert msg.startswith("ValueError: ") and expected in msg, msg


def test_model_without_herald_ebc_is_rejected() -> None:
    for r in behaviour():
        msg = r["not_herald"]
        assert msg.startswith("ValueError: ") and "HeraldEmbeddingBagCollectionSharder" in msg, msg


@pytest.mark.parametrize("name", ["too_large", "negative"])
def test_bad_id_on_one_rank_raises_on_every_rank(name: str) -> None:
    res = behaviour()
    n = res[0]["num_embeddings"]
    bad = n if name == "too_large" else -1
    for r in res:
        msg = r[f"bad_{name}"]
        assert msg.startswith("ValueError: "), msg
        assert f"id {bad} " in msg and f"'{BAD_FEATURE}'" in msg and f"'t_{BAD_FEATURE}'" in msg, msg
        assert f"[0, {n})" in msg and "rank 1" in msg, msg
        assert r[f"bad_{name}_steps"] == (0 if name == "too_large" else BAD_STEP)


def test_flush_after_bad_id_mid_run_keeps_the_trained_steps() -> None:
    for r in behaviour():
        _assert_close(r["after_bad_state"], r["after_bad_stock_state"], "sgd")


def test_rank_without_ids_trains_exactly() -> None:
    for r in behaviour():
        (h_loss, h_state), (s_loss, s_state) = r["empty_rank"]["herald"], r["empty_rank"]["table_wise"]
        assert len(h_loss) == len(s_loss) == 6
        assert max(abs(a - b) / abs(b) for a, b in zip(h_loss, s_loss)) <= RTOL
        _assert_close(h_state, s_state, "sgd")


def _assert_close(h: Dict[str, torch.Tensor], s: Dict[str, torch.Tensor], optimizer: str) -> None:
    """Herald's and stock's weights within the tolerance of the optimizer the run trained with."""
    assert set(h) == set(s)
    bad = {k: rel(h[k], s[k]) for k in s if not rel(h[k], s[k]) <= weight_rtol(optimizer)}
    assert not bad, bad


def _mean(res: List[Dict[str, Any]], key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in res], dtype=torch.float64).mean(0)


def test_flush_mid_run_gives_stock_state_and_training_goes_on_exactly() -> None:
    res = behaviour()
    for r in res:
        # the flush moved rows home / to stale replicas; the second one moved nothing at all
        assert sum(v["bytes"] for v in r["first_flush_traffic"].values()) > 0, r["first_flush_traffic"]
        assert r["second_flush_traffic"] == {}, r["second_flush_traffic"]
        assert r["second_detach_traffic"] == {}, r["second_detach_traffic"]
        _assert_close(r["herald_state_3"], r["stock_state_3"], "rowwise_adagrad")
        _assert_close(r["herald_state_12"], r["stock_state_12"], "rowwise_adagrad")
        assert len(r["herald_losses"]) == len(r["stock_losses"]) == 12
    h, s = _mean(res, "herald_losses"), _mean(res, "stock_losses")
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL
    # after a flush every rank holds the same model: the same state (sharded blocks gathered) and the
    # same hot replicas
    for key in ("raw_state_3", "raw_state_12"):
        a, b = res[0][key], res[1][key]
        assert set(a) == set(b) and sum(".embedding_bags." in k for k in a) == 26 and a["hot"].numel() > 0
        for k in a:
            assert torch.equal(a[k], b[k]), (key, k)


def test_checkpoint_after_pipeline_loads_into_stock_table_wise() -> None:
    for r in behaviour():
        assert len(r["loaded_equal"]) > 26 and all(r["loaded_equal"].values()), r["loaded_equal"]
        assert torch.allclose(r["herald_logits"], r["loaded_logits"], rtol=1e-6, atol=1e-7), \
            (r["herald_logits"] - r["loaded_logits"]).abs().max()


def test_detached_model_trains_on_exactly_with_herald_path() -> None:
    res = behaviour()
    h, s = _mean(res, "herald_more"), _mean(res, "stock_more")
    assert len(h) == 3 and float(((h - s).abs() / s.abs()).max()) <= RTOL
    for r in res:
        # identity sample placement after detach: each rank's own loss matches too
        assert max(abs(a - b) / abs(b) for a, b in zip(r["herald_more"], r["stock_more"])) <= RTOL
        _assert_close(r["herald_state_more"], r["stock_state_more"], "rowwise_adagrad")
