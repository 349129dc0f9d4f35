"""The compiled batch stages (native/batch_keys.cpp) give the torch ops' tensors: a batch's keys and samples
(keys stage), every rank's sorted unique reads and this rank's keys (reads stage), and a sample selection
of a KJT's bags (allocate stage); bad input is named."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_herald.pipeline.context as context
import torchrec_herald.pipeline.stages.keys as keys_stage
import torchrec_herald.pipeline.stages.reads as reads_stage
from torchrec_herald import native
from torchrec_herald.layout import RowLayout
from torchrec_herald.pipeline.context import HeraldBatchContext, select_samples

ROWS = {"a": 50, "b": 7, "c": 1000}


def _batch(g: torch.Generator, B: int, max_len: int = 3, dtype: torch.dtype = torch.int64,
           empty_share: float = 0.2) -> Batch:
    feats = list(ROWS)
    lengths = torch.randint(0, max_len + 1, (len(feats), B), generator=g)
    lengths[torch.rand(lengths.shape, generator=g) < empty_share] = 0
    values = torch.cat([torch.randint(0, ROWS[f], (int(lengths[i].sum()),), generator=g)
                        for i, f in enumerate(feats)])
    kjt = KeyedJaggedTensor(keys=feats, values=values.to(dtype), lengths=lengths.flatten().to(dtype))
    return Batch(dense_features=torch.randn(B, 4, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (B,), generator=g).float())


def _env(world: int = 2, rank: int = 0) -> SimpleNamespace:
    lay = RowLayout.build(world, ROWS)
    ebc = SimpleNamespace(layout=lay, batch_feature_order=lambda kjt: kjt,
                          bad_id_error=lambda ranks, f, x: ValueError(f"bad id {x} of feature {f} on ranks {ranks}"))
    return SimpleNamespace(ebc=ebc, layout=lay, world=world, rank=rank)


def _both(monkeypatch: pytest.MonkeyPatch, module: Any, fn: Any) -> tuple:
    """``fn()`` compiled, then with ``module``'s torch ops."""
    assert module.load_if_built() is native.load()
    compiled = fn()
    with monkeypatch.context() as m:
        m.setattr(module, "load_if_built", lambda: None)
        ops = fn()
    return compiled, ops


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("B", [1, 16, 100])
def test_compiled_keys_stage_gives_the_torch_ops_keys_and_samples(monkeypatch: pytest.MonkeyPatch,
                                                                   dtype: torch.dtype, B: int) -> None:
    env, batch = _env(), _batch(torch.Generator().manual_seed(B), B, dtype=dtype)

    def run() -> HeraldBatchContext:
        ctx = HeraldBatchContext()
        keys_stage.key_batch(env, ctx, batch, whole_batch=True)
        return ctx

    a, b = _both(monkeypatch, keys_stage, run)
    assert a.keys.dtype == torch.int64 and torch.equal(a.keys, b.keys)
    assert torch.equal(a.sample_of_key, b.sample_of_key) and a.bad == b.bad == (0, 0, 0)
    # the keys are the layout's: feature offset + id
    lengths = batch.sparse_features.lengths().to(torch.int64)
    feature = torch.repeat_interleave(torch.arange(3).repeat_interleave(B), lengths)
    assert torch.equal(a.keys, env.layout.feature_offsets[feature] + batch.sparse_features.values().to(torch.int64))


@pytest.mark.parametrize("whole_batch", [True, False])
def test_a_bad_id_is_named_alike_with_the_compiled_keys_stage(monkeypatch: pytest.MonkeyPatch,
                                                             whole_batch: bool) -> None:
    env, batch = _env(), _batch(torch.Generator().manual_seed(1), 8, empty_share=0.0)
    kjt = batch.sparse_features
    values = kjt.values().clone()
    values[int(kjt.lengths()[:8].sum()) + 1] = 7  # feature "b" (7 rows): id 7 is outside it
    batch = Batch(batch.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()), batch.labels)

    def run() -> Any:
        ctx = HeraldBatchContext()
        try:
            keys_stage.key_batch(env, ctx, batch, whole_batch=whole_batch)
        except ValueError as e:
            return str(e)
        return ctx.bad, ctx.keys

    a, b = _both(monkeypatch, keys_stage, run)
    if whole_batch:
        assert a == b and a.startswith("bad id 7 of feature 1 on ranks [")
    else:
        assert a == b == ((1, 1, 7), None)


def test_compiled_batch_keys_counts_ids_outside_their_table_and_checks_lengths() -> None:
    lay = _env().layout
    mod = native.load()
    values = torch.tensor([0, 49, 50, -1, 6, 7, 999])
    lengths = torch.tensor([1, 3, 2, 1])  # features a and b, 2 samples each
    offsets, rows = lay.feature_offsets[:2], lay.rows_per_feature[:2]
    keys, sample, invalid = mod.batch_keys(values, lengths, offsets, rows, 2)
    assert int(invalid) == 4  # 50 and -1 in "a" (50 rows), 7 and 999 in "b" (7 rows)
    assert sample.tolist() == [0, 1, 1, 1, 0, 0, 1]
    with pytest.raises(RuntimeError, match="do not add up|add up to"):
        mod.batch_keys(values, torch.tensor([1, 3, 2, 2]), offsets, rows, 2)
    with pytest.raises(RuntimeError, match="3 lengths for 2 features of 2 samples"):
        mod.batch_keys(values, torch.tensor([1, 3, 2]), offsets, rows, 2)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_compiled_reads_stage_gives_every_ranks_reads_and_this_ranks_keys(monkeypatch: pytest.MonkeyPatch,
                                                                           world: int) -> None:
    g = torch.Generator().manual_seed(world)
    for rank in range(world):
        env = _env(world, rank)
        batch = _batch(g, 12 * world)
        ctx0 = HeraldBatchContext()
        keys_stage.key_batch(env, ctx0, batch, whole_batch=True)
        rank_of = torch.randint(0, world, (12 * world,), generator=g)

        def run() -> HeraldBatchContext:
            ctx = HeraldBatchContext(keys=ctx0.keys.clone(), sample_of_key=ctx0.sample_of_key.clone(),
                                     rank_of=rank_of.clone())
            reads_stage.reads_from_assignment(env, ctx, True)
            return ctx

        a, b = _both(monkeypatch, reads_stage, run)
        assert len(a.reads) == len(b.reads) == world
        assert all(torch.equal(x, y) for x, y in zip(a.reads, b.reads))
        assert torch.equal(a.keys, b.keys) and a.rank_of is None and a.sample_of_key is None
        assert torch.equal(a.reads[rank], torch.unique(b.keys))


def test_compiled_sorted_unique_is_torch_unique_and_refuses_negative_keys() -> None:
    mod = native.load()
    g = torch.Generator().manual_seed(0)
    for hi in (1, 5, 3000, 2 ** 23 + 7, 2 ** 40):
        k = torch.randint(0, hi, (5000,), generator=g)
        assert torch.equal(mod.sorted_unique_keys(k), torch.unique(k))
    assert mod.sorted_unique_keys(torch.empty(0, dtype=torch.int64)).numel() == 0
    assert torch.equal(mod.sorted_unique_keys(torch.tensor([3, 1, 3], dtype=torch.int32)), torch.tensor([1, 3]))
    with pytest.raises(RuntimeError, match="key -2 is negative"):
        mod.sorted_unique_keys(torch.tensor([4, -2]))


def test_compiled_reads_by_rank_refuses_keys_and_ranks_out_of_range() -> None:
    mod = native.load()
    k, s = torch.tensor([1, 2]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"key 9 outside \[0, 5\)"):
        mod.reads_by_rank(torch.tensor([1, 9]), s, torch.tensor([0, 1]), 2, 5, 0)
    with pytest.raises(RuntimeError, match="sample 1 assigned to rank 2 of 2"):
        mod.reads_by_rank(k, s, torch.tensor([0, 2]), 2, 5, 0)
    with pytest.raises(RuntimeError, match="sample 1 outside the 1 assigned"):
        mod.reads_by_rank(k, s, torch.tensor([0]), 2, 5, 0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_compiled_sample_selection_gives_the_torch_ops_batch(monkeypatch: pytest.MonkeyPatch,
                                                              dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    batch = _batch(g, 40, max_len=4, dtype=dtype)
    for index in (torch.randperm(40, generator=g)[:17], torch.arange(40), torch.empty(0, dtype=torch.int64),
                  torch.tensor([5, 5, 0])):
        a, b = _both(monkeypatch, context, lambda: select_samples(batch, index))
        ka, kb = a.sparse_features, b.sparse_features
        assert ka.keys() == kb.keys() and ka.stride() == kb.stride() == index.numel()
        assert ka.values().dtype == kb.values().dtype == dtype and ka.lengths().dtype == kb.lengths().dtype
        assert torch.equal(ka.values(), kb.values()) and torch.equal(ka.lengths(), kb.lengths())
        assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
    with pytest.raises(RuntimeError, match="sample 40 of 40"):
        native.load().select_bags(batch.sparse_features.lengths(), batch.sparse_features.values(),
                                  torch.tensor([40]), 40)
