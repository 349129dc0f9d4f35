"""A loader of each rank's own batches, through ``HeraldTrainPipeline``: every rank describes its batch to
the others before any exchange sized by it, so a loader that runs dry before the others' or a batch the
others cannot train with raises the same clear error on every rank (no rank left waiting in a collective,
no sample moved without its weights), scheduling on or off. Labels of several values a sample (a
multi-task model) move with their samples."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Dict, Iterator, List

import pytest
import torch

from herald_harness import error_of
from torchrec_herald.dist_utils import run_multiprocess

STEPS = 6


def _edited(batch: Any, **change: Any) -> Any:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.sparse_features
    if "keep" in change:  # the first ``keep`` samples only
        n = change["keep"]
        idx = torch.arange(n)
        from torchrec_herald.pipeline.context import select_samples

        return select_samples(batch, idx)
    if "extra" in change:
        jt = {k: kjt[k] for k in kjt.keys()}
        jt[change["extra"]] = kjt[kjt.keys()[0]]
        return Batch(batch.dense_features, KeyedJaggedTensor.from_jt_dict(jt), batch.labels)
    if "weights" in change:
        weighted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                     weights=torch.full((kjt.values().numel(),), 3.0))
        return Batch(batch.dense_features, weighted, batch.labels)
    if "dense" in change:
        return Batch(batch.dense_features[:, : change["dense"]], kjt, batch.labels)
    raise AssertionError(change)


def _loader(batches: List[Any], rank: int, case: str) -> Iterator[Any]:
    """This rank's batches, rank 1's spoilt at batch 2 by ``case``."""
    for i, b in enumerate(batches):
        if rank == 1 and i == 2:
            if case == "runs_dry":
                return
            if case == "partial":
                b = _edited(b, keep=b.labels.numel() - 3)
            elif case == "extra_feature":
                b = _edited(b, extra="zz")
            elif case == "weighted":
                b = _edited(b, weights=True)
            elif case == "dense_columns":
                b = _edited(b, dense=2)
            elif case == "not_a_batch":
                b = b.sparse_features
            elif case == "labels_task_first":  # [1, B] beside the others' [B]: a move could not carry them
                b = type(b)(b.dense_features, b.sparse_features, b.labels.view(1, -1))
        yield b


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from herald_harness import build, full_state

    from torchrec_herald.pipeline import HeraldTrainPipeline

    out: Dict[str, Any] = {}
    for scheduling in ("on", "off"):
        for case in ("runs_dry", "partial", "extra_feature", "weighted", "dense_columns", "not_a_batch",
                     "labels_task_first"):
            b = build(world, dict(planner="herald", steps=STEPS, batch_size=16))
            batches = list(b["data"].train_batches(rank, world, b["batch_size"]))
            pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], scheduling=scheduling, window=2)
            it = _loader(batches, rank, case)

            def train() -> None:
                for _ in itertools.count():
                    pipe.progress(it)

            out[(scheduling, case)] = error_of(train)
            if case == "partial":  # the bad batch is dropped on every rank: the next progress() trains on,
                # and the rest of the loader trains as if batch 2 had never been read on any rank
                out[(scheduling, "after_partial")] = error_of(lambda: pipe.progress(it))
                out[(scheduling, "after_partial_end")] = error_of(train)
                out[(scheduling, "after_partial_state")] = full_state(b["dmp"])
                ref = build(world, dict(planner="herald", steps=STEPS, batch_size=16))
                ref_pipe = HeraldTrainPipeline(ref["dmp"], ref["optimizer"], ref["device"], scheduling=scheduling,
                                               window=2)
                ref_it = iter([x for i, x in enumerate(batches) if i != 2])
                out[(scheduling, "without_batch_2_end")] = error_of(lambda: [ref_pipe.progress(ref_it)
                                                                             for _ in itertools.count()])
                out[(scheduling, "without_batch_2_state")] = full_state(ref["dmp"])
        # a used-up loader: progress() says so as TorchRec's pipelines do, with StopIteration again
        b = build(world, dict(planner="herald", steps=STEPS, batch_size=16))
        pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], scheduling=scheduling, window=2)
        it = iter(list(b["data"].train_batches(rank, world, b["batch_size"])))
        out[(scheduling, "to_the_end")] = error_of(train)
        out[(scheduling, "used_up")] = error_of(lambda: pipe.progress(it))
        out[(scheduling, "times")] = (pipe.stats.scheduler_s, pipe.stats.comm_s)
    return out


@functools.lru_cache(maxsize=None)
def results() -> List[Dict[Any, str]]:
    return run_multiprocess(_worker, 2, timeout_s=300)


EXPECTED = {
    "runs_dry": "ValueError: HeraldTrainPipeline, batch 2: the data loader of rank(s) [1] ran out while rank(s) [0] "
                "still had batches; every rank's loader must yield the same number of batches (drop the remainder)",
    "partial": "ValueError: HeraldTrainPipeline, batch 2: every rank's batch must have the same number of samples (a "
               "last partial batch on some ranks only: drop it, as drop_last=True does) (rank 0: 16, rank 1: 13)",
    "extra_feature": "ValueError: HeraldTrainPipeline, batch 2: every rank's batch must have the same features (in any "
                     "order); rank 0's KJT has [",
    "weighted": "ValueError: HeraldTrainPipeline, batch 2: the KJT of rank(s) [1] carries per-sample weights; herald's "
                "tables t_cat_0, t_cat_1, t_cat_2, t_cat_3, … (26 in all) (features cat_0, cat_1, cat_2, cat_3, … (26 in "
                "all)) read it, and herald's sharding has no per-sample weights",
    "dense_columns": "ValueError: HeraldTrainPipeline, batch 2: every rank's batch must have the same number of dense "
                     "features (dense_features of shape [samples, columns]) (rank 0: 13, rank 1: 2)",
    "not_a_batch": "TypeError: HeraldTrainPipeline, batch 2: the data loader of rank(s) [1] yielded ",
    "labels_task_first": "ValueError: HeraldTrainPipeline, batch 2: every rank's batch must have the same number of "
                         "label values per sample (labels of shape [samples] or [samples, tasks]) (rank 0: 1, rank 1: "
                         "not one row a sample)",
}


@pytest.mark.parametrize("scheduling", ["on", "off"])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_batch_one_rank_cannot_train_with_the_others_raises_the_same_error_on_every_rank(case: str,
                                                                                          scheduling: str) -> None:
    got = [r[(scheduling, case)] for r in results()]
    assert got[0].startswith(EXPECTED[case]), got
    assert got[1] == got[0] or case == "not_a_batch", got  # (the type named is the rank's own)
    assert got[1].startswith(EXPECTED[case]), got
    if case == "extra_feature":
        assert got[0].endswith("'zz']"), got[0]


def _labels_worker(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.datasets.utils import Batch

    from herald_harness import build
    from torchrec_herald.pipeline.context import SchedulerStats, find_herald_ebc
    from torchrec_herald.pipeline.stages.allocate import exchange_samples

    b = build(world, dict(planner="herald", steps=1, batch_size=8))
    batch = next(iter(b["data"].train_batches(rank, world, 8)))
    labels = torch.stack([batch.labels, batch.labels + 10 * (rank + 1)], 1)  # [B, 2]: two tasks
    two = Batch(batch.dense_features, batch.sparse_features, labels)
    env = type("Env", (), dict(world=world, rank=rank, scheduling_group=None, stats=SchedulerStats()))()
    dest = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])  # where each of this rank's samples goes
    every_dest = torch.cat([dest, dest])  # both ranks send alike
    incoming = (every_dest == rank).nonzero().flatten()
    moved = exchange_samples(env, two, dest, incoming)
    find_herald_ebc(b["dmp"])  # (built as a run builds it)
    return {"labels": moved.labels, "sent": labels, "incoming": incoming}


def test_labels_of_several_values_a_sample_move_with_their_samples() -> None:
    res = run_multiprocess(_labels_worker, 2, timeout_s=180)
    for r in res:
        want = torch.cat([res[src]["sent"] for src in range(2)])[r["incoming"]]
        assert r["labels"].shape == want.shape == (8, 2) and torch.equal(r["labels"], want)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_progress_on_a_used_up_loader_raises_stop_iteration_again(scheduling: str) -> None:
    assert [r[(scheduling, k)] for r in results() for k in ("to_the_end", "used_up")] == ["StopIteration: "] * 4


def test_features_of_other_tables_are_carried_in_one_order_whatever_order_a_loader_gives() -> None:
    """A moved sample's bags are matched by position: every rank's batch must list the features no herald
    table serves (a mixed EBC's stock tables') alike, by name after herald's own."""
    from types import SimpleNamespace

    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection

    module = SimpleNamespace(_feature_names=["a", "b"])
    jt = {k: JaggedTensor(values=torch.tensor([i, i]), lengths=torch.tensor([1, 1])) for i, k in enumerate("zaby")}
    orders = [["z", "a", "b", "y"], ["y", "b", "z", "a"], ["a", "b", "y", "z"]]
    got = [ShardedHeraldEmbeddingBagCollection.batch_feature_order(module, KeyedJaggedTensor.from_jt_dict(
        {k: jt[k] for k in order})) for order in orders]
    for kjt in got:
        assert kjt.keys() == ["a", "b", "y", "z"] and kjt.values().tolist() == [1, 1, 2, 2, 3, 3, 0, 0]


def _weighted_worker(rank: int, world: int) -> str:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder, HotSpec

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=32, feature_names=[f"f{i}"])
              for i in range(2)]
    model = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection(tables, is_weighted=True, device=torch.device("meta"))})
    sharder = HeraldEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                "learning_rate": 0.1})
    row_wise = stock_plan(model, tables, [sharder], "row_wise", world, 8, torch.device("cpu"))
    plan = herald_plan_from_row_wise(row_wise, {t.name: HotSpec(torch.arange(2)) for t in tables})
    return error_of(lambda: DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder]))


def test_a_weighted_ebc_is_refused_when_herald_shards_it() -> None:
    (got,) = run_multiprocess(_weighted_worker, 1, timeout_s=180)
    assert got == ("ValueError: EBC 'ebc' is weighted (is_weighted=True), and the plan gives its tables ['t0', 't1'] "
                   "herald's sharding, which has no per-sample weights: plan them with a stock sharding type"), got


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_a_batch_that_raised_is_dropped_and_the_rest_trains_as_without_it(scheduling: str) -> None:
    """After the partial batch's error, training goes on to the loader's end and ends with the weights of the
    same model trained on every batch but that one, on every rank."""
    from herald_harness import weight_rtol

    for r in results():
        assert r[(scheduling, "after_partial")] == "no error"
        assert r[(scheduling, "after_partial_end")] == r[(scheduling, "without_batch_2_end")] == "StopIteration: ", r
        got, want = r[(scheduling, "after_partial_state")], r[(scheduling, "without_batch_2_state")]
        assert got.keys() == want.keys()
        for k in want:
            gap = float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12))
            assert gap <= weight_rtol("sgd"), (k, gap)


@pytest.mark.parametrize("scheduling", ["on", "off"])
def test_the_checks_gathers_count_as_scheduler_time_where_they_run(scheduling: str) -> None:
    """Scheduling off, the check runs on the training thread: its gathers are scheduler time on the step's
    path, never more communication than the scheduler's time holds."""
    for r in results():
        scheduler_s, comm_s = r[(scheduling, "times")]
        assert comm_s > 0 and scheduler_s >= comm_s, (scheduler_s, comm_s)
