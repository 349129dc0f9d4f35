"""Tests of the synthetic Criteo-like source, coverage helpers and build_data_source."""

import itertools
from pathlib import Path
from typing import List

import pytest
import torch
from omegaconf import OmegaConf
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    CALIBRATION_MIN_ROWS,
    DEFAULT_ZIPF_ALPHA,
    SyntheticCriteo,
    TrainStream,
    build_data_source,
    calibrate_zipf_alpha,
    global_coverage,
    measured_coverage,
    scaled_num_embeddings,
    table_coverage,
)



def same(a: Batch, b: Batch) -> bool:
    ka, kb = a.sparse_features, b.sparse_features
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and ka.keys() == kb.keys()
        and torch.equal(ka.values(), kb.values())
        and torch.equal(ka.lengths(), kb.lengths())
    )


def concat(batches: List[Batch]) -> Batch:
    """Concatenate rank batches along the sample axis (per feature for the KJT)."""
    keys = batches[0].sparse_features.keys()
    per_rank = [b.sparse_features.to_dict() for b in batches]
    return Batch(
        dense_features=torch.cat([b.dense_features for b in batches]),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys,
            torch.cat([d[k].values() for k in keys for d in per_rank]),
            torch.cat([d[k].lengths() for k in keys for d in per_rank]),
        ),
        labels=torch.cat([b.labels for b in batches]),
    )


def test_scaled_num_embeddings() -> None:
    assert scaled_num_embeddings(0.01) == [
        16, 16, 101313, 22027, 16, 16, 126, 16, 3, 932, 57, 83516, 32,
        16, 150, 54614, 10, 57, 22, 4, 70466, 16, 15, 2862, 16, 1426,
    ]  # fmt: skip
    assert scaled_num_embeddings(1.0) == list(CRITEO_KAGGLE_CARDINALITIES)
    with pytest.raises(ValueError, match="scale"):
        scaled_num_embeddings(0)


def test_batch_structure() -> None:
    src = SyntheticCriteo(num_train_batches=3)
    batches = list(src.train_batches(rank=0, world_size=1, batch_size=32))
    assert len(batches) == 3
    b = batches[0]
    assert b.dense_features.shape == (32, 13) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (32,) and b.labels.dtype == torch.float32
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert (b.dense_features >= 0).all()
    kjt = b.sparse_features
    assert kjt.keys() == list(DEFAULT_CAT_NAMES) == src.feature_names
    assert kjt.values().dtype == torch.int64 and kjt.stride() == 32
    assert torch.equal(kjt.lengths(), torch.ones(26 * 32, dtype=kjt.lengths().dtype))
    for f, (key, jt) in enumerate(kjt.to_dict().items()):
        assert 0 <= int(jt.values().min()) and int(jt.values().max()) < src.num_embeddings[f], key


def test_determinism_and_seeds() -> None:
    a = list(SyntheticCriteo(seed=3, num_train_batches=2).train_batches(0, 1, 64))
    b = list(SyntheticCriteo(seed=3, num_train_batches=2).train_batches(0, 1, 64))
    c = list(SyntheticCriteo(seed=4, num_train_batches=2).train_batches(0, 1, 64))
    ev = list(SyntheticCriteo(seed=3, num_eval_batches=2).eval_batches(0, 1, 64))
    assert all(same(x, y) for x, y in zip(a, b))
    assert not same(a[0], c[0]) and not same(a[0], ev[0]) and not same(a[0], a[1])


@pytest.mark.parametrize("missing_rate", [0.0, 0.3])
def test_rank_slices_concatenate_to_global_batch(missing_rate: float) -> None:
    src = SyntheticCriteo(num_train_batches=2, missing_rate=missing_rate)
    whole = list(src.train_batches(0, 1, 128))
    ranks = [list(src.train_batches(r, 4, 32)) for r in range(4)]
    for i, g in enumerate(whole):
        assert same(concat([ranks[r][i] for r in range(4)]), g)


def test_train_stream_switches_between_whole_batches_and_slices_without_skipping_one() -> None:
    """``TrainStream`` reads each global batch once, whole or as the rank's slice as ``whole`` says when
    it is read; ``train_batches_from`` seeks (here without generating the batches before ``start``)."""
    src = SyntheticCriteo(num_train_batches=6, missing_rate=0.2)
    whole = list(src.train_batches(0, 1, 96))
    mine = list(src.train_batches(1, 3, 32))
    stream = TrainStream(src, 1, 3, 32, start=1, whole=True)
    got = []
    for want_whole in (True, False, False, True):
        stream.whole = want_whole
        got.append(next(stream))
    assert [b.labels.numel() for b in got] == [96, 32, 32, 96] and stream.position == 5
    assert same(got[0], whole[1]) and same(got[1], mine[2]) and same(got[2], mine[3]) and same(got[3], whole[4])
    stream.whole = False
    assert same(next(stream), mine[5]) and next(stream, None) is None
    assert all(same(a, b) for a, b in zip(src.train_batches_from(1, 3, 32, 4), mine[4:]))
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        next(src.train_batches_from(0, 1, 32, -1))


def test_missing_rate_gives_empty_bags() -> None:
    b = next(SyntheticCriteo(missing_rate=0.3).train_batches(0, 1, 1000))
    lengths = b.sparse_features.lengths()
    assert set(lengths.unique().tolist()) == {0, 1}
    assert abs((lengths == 0).float().mean().item() - 0.3) < 0.02


def test_coverage_calibration() -> None:
    """Default skew: the top 2 % of the large tables' rows take ~90 % of their lookups."""
    src = SyntheticCriteo()
    assert src.zipf_alpha == DEFAULT_ZIPF_ALPHA == 1.22
    per_table, analytical = src.coverage(0.02)
    assert analytical == pytest.approx(0.9004, abs=1e-4)
    assert analytical == global_coverage(src.num_embeddings, DEFAULT_ZIPF_ALPHA, 0.02, CALIBRATION_MIN_ROWS)
    assert calibrate_zipf_alpha(src.num_embeddings, 0.02, 0.90) == pytest.approx(1.219, abs=0.001)
    # over all 26 tables (tiny tables fully "hot") the same alpha covers more
    assert global_coverage(src.num_embeddings, DEFAULT_ZIPF_ALPHA, 0.02) == pytest.approx(0.9698, abs=1e-4)
    # cat_8 has 3 rows: its top ceil(0.02 * 3) = 1 row gets 1 / (1 + 2^-a + 3^-a) of its lookups
    assert per_table["cat_8"] == pytest.approx(1 / (1 + 2**-1.22 + 3**-1.22))
    assert per_table["cat_2"] == pytest.approx(table_coverage(101313, 1.22, 0.02))
    batches = [b.sparse_features for b in itertools.islice(src.train_batches(0, 1, 512), 50)]
    measured_tables, measured = measured_coverage(batches, src.num_embeddings, 0.02, CALIBRATION_MIN_ROWS)
    assert 0.85 <= measured <= 0.95
    # a finite sample ranks rows by observed counts, which slightly overstates coverage
    assert 0 <= measured - analytical <= 0.02
    assert measured == pytest.approx(0.9149, abs=1e-4)  # pinned: generator is deterministic
    assert set(measured_tables) == set(DEFAULT_CAT_NAMES)


def test_labels_are_learnable() -> None:
    src = SyntheticCriteo(num_train_batches=10)
    batches = list(src.train_batches(0, 1, 512))
    labels = torch.cat([b.labels for b in batches])
    logits = torch.cat([src.oracle_logits(b) for b in batches])
    assert 0.2 < labels.mean().item() < 0.35
    assert binary_auroc(logits, labels.long()).item() > 0.75


def test_build_from_the_hydra_config() -> None:
    from torchrec_herald.config import compose_config

    cfg = compose_config(["data=synthetic"]).data
    src = build_data_source(cfg)
    assert isinstance(src, SyntheticCriteo)
    assert (src.seed, src.scale, src.zipf_alpha, src.num_train_batches, src.num_eval_batches) == (
        0, 0.01, DEFAULT_ZIPF_ALPHA, 1000, 20,
    )  # fmt: skip
    assert src.stats() == {"skipped_lines": 0, "dropped_tail_samples": 0}


def test_build_rejects_unknown_keys_and_names() -> None:
    with pytest.raises(ValueError, match=r"data source 'synthetic': unknown config key\(s\) \['zipf'\]"):
        build_data_source({"name": "synthetic", "zipf": 1.0})
    with pytest.raises(ValueError, match=r"unknown data source name 'kaggle'; known: \['columnar', 'criteo_tsv', 'synthetic'\]"):
        build_data_source({"name": "kaggle"})
    with pytest.raises(ValueError, match="missing_rate"):
        build_data_source({"name": "synthetic", "missing_rate": 1.5})


def test_bad_rank_arguments() -> None:
    with pytest.raises(ValueError, match="rank"):
        next(SyntheticCriteo().train_batches(2, 2, 8))


@pytest.mark.parametrize("kw", [dict(), dict(seed=5, missing_rate=0.3), dict(scale=0.001, zipf_alpha=0.0)])
def test_compiled_sampling_gives_the_torch_ops_batches_bit_for_bit(kw: dict) -> None:
    """The compiled inverse-CDF search and effect sums (native/synthetic_sample.cpp) give the same ids,
    presence and labels as ``torch.searchsorted`` and one torch add per table, whole batches and slices."""
    from torchrec_herald import native

    compiled, ops = SyntheticCriteo(**kw), SyntheticCriteo(**kw)
    assert compiled._sampler._native is native.load()
    ops._sampler._native = None
    for i in range(6):
        for rows in (slice(None), slice(40, 200)):
            a, b = compiled.global_batch("train", i, 256, rows), ops.global_batch("train", i, 256, rows)
            assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_compiled_sampling_takes_upper_bounds_at_exact_cdf_values_and_clamps_past_the_last() -> None:
    """A draw equal to a CDF entry takes the next row (``searchsorted(right=True)``), 0 the first row, and
    a draw past the last entry (rounding: the CDF may end below 1) the last row."""
    src = SyntheticCriteo(scale=0.001)
    sampler, table = src._sampler, 3
    cdf, perm = sampler.cdfs[table], sampler.perms[table]
    n = len(cdf)
    u = torch.rand(len(src.num_embeddings), 5, dtype=torch.float64)
    u[table] = torch.tensor([0.0, float(cdf[0]), float(cdf[1]), float(cdf[n - 2]), float(cdf[-1]) + 1e-12])
    ids, flat = sampler(u)
    assert ids[table].tolist() == [int(perm[0]), int(perm[1]), int(perm[2]), int(perm[n - 1]), int(perm[n - 1])]
    assert torch.equal(flat - ids, sampler._offsets.expand_as(ids))
    sampler._native = None
    want, _ = sampler(u)
    assert torch.equal(ids, want)


@pytest.mark.parametrize("key, value, message", [
    ("zipf_alpha", float("nan"), "data.zipf_alpha must be a finite number >= 0, got nan"),
    ("zipf_alpha", float("inf"), "data.zipf_alpha must be a finite number >= 0, got inf"),
    ("scale", 0.0, "data.scale must be a finite number > 0, got 0.0"),
    ("scale", float("inf"), "data.scale must be a finite number > 0, got inf"),
    ("missing_rate", 1.0, r"data.missing_rate must be in \[0, 1\), got 1.0"),
])
def test_a_bad_synthetic_value_is_named_by_its_config_key(key: str, value: float, message: str) -> None:
    from torchrec_herald.data import build_data_source

    with pytest.raises(ValueError, match=f"^{message}$"):
        build_data_source({"name": "synthetic", key: value})


def test_a_scale_whose_generator_would_not_fit_in_memory_is_named_by_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """``data.scale=1e9`` failed in an allocation of 2.7e17 bytes naming no key: the generator's rows (20 bytes
    each, every rank) are checked against the host's memory first (here a host of 0.5 GiB, so a scale of 1, 0.6 GiB,
    is refused)."""
    from torchrec_herald.data import build_data_source
    from torchrec_herald.data import synthetic

    monkeypatch.setattr(synthetic, "host_memory_bytes", lambda: 2**29)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    rows = sum(synthetic.scaled_num_embeddings(1.0))
    with pytest.raises(ValueError) as e:
        build_data_source({"name": "synthetic", "scale": 1.0})
    assert str(e.value) == (f"data.scale=1 gives {rows:,} rows in all; the synthetic generator holds 20 bytes a row on "
                            f"each of this host's 1 rank(s) ({20 * rows / 2**30:,.1f} GiB), more than its 0.5 GiB: lower it "
                            f"(1.0 is Criteo Kaggle's size)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # (8 ranks on a host of 4 GiB: 8 generators of 0.6 GiB do not fit)
    monkeypatch.setattr(synthetic, "host_memory_bytes", lambda: 2**32)
    with pytest.raises(ValueError, match=r"on each of this host's 8 rank\(s\)"):
        build_data_source({"name": "synthetic", "scale": 1.0})
    assert build_data_source({"name": "synthetic", "scale": 0.01}).num_embeddings == synthetic.scaled_num_embeddings(0.01)
