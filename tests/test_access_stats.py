"""Tests of AccessStats: exact counting, errors, coverage, persistence, validation."""

import logging
from pathlib import Path
from typing import List, Sequence

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.planner.stats import AccessStats


def table(name: str, n: int, features: Sequence[str], dim: int = 4) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=n, feature_names=list(features))


TABLES = [table("t_a", 5, ["fa"]), table("t_b", 8, ["fb1", "fb2"])]


def kjt(bags: dict) -> KeyedJaggedTensor:
    """KJT from ``{key: [bag, bag, ...]}`` (every key the same number of bags)."""
    keys = list(bags)
    values: List[int] = [i for k in keys for bag in bags[k] for i in bag]
    lengths = [len(bag) for k in keys for bag in bags[k]]
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values, dtype=torch.int64),
                                               torch.tensor(lengths, dtype=torch.int32))


def batches() -> List[KeyedJaggedTensor]:
    return [
        # multi-id bags, repeated ids in a bag, empty bags; t_b serves two features
        kjt({"fa": [[1, 1, 2], [], [4]], "fb1": [[0], [7, 7], []], "fb2": [[7], [], [3, 0]]}),
        kjt({"fa": [[2], [2]], "fb1": [[], [5]], "fb2": [[5, 5], [1]]}),
        kjt({"fa": [[0]]}),  # a batch with a subset of the keys
    ]


def i64(x: Sequence[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def test_from_batches_exact_counts() -> None:
    s = AccessStats.from_batches(batches(), TABLES)
    assert s.tables == ["t_a", "t_b"]
    assert s.num_batches == 3 and s.num_samples == 6
    assert s.feature_names == {"t_a": ["fa"], "t_b": ["fb1", "fb2"]}
    assert torch.equal(s.counts["t_a"], i64([1, 2, 3, 0, 1]))
    assert torch.equal(s.presence["t_a"], i64([1, 1, 2, 0, 1]))
    assert torch.equal(s.sample_counts["t_a"], i64([1, 1, 3, 0, 1]))
    assert torch.equal(s.counts["t_b"], i64([2, 1, 0, 1, 0, 3, 0, 3]))
    assert torch.equal(s.presence["t_b"], i64([1, 1, 0, 1, 0, 1, 0, 1]))
    assert torch.equal(s.sample_counts["t_b"], i64([2, 1, 0, 1, 0, 2, 0, 2]))
    for c in (s.counts, s.presence, s.sample_counts):
        assert all(v.dtype == torch.int64 for v in c.values())
    lam = s.lookups_per_step("t_a", 12)
    assert lam.dtype == torch.float64
    assert torch.equal(lam, torch.tensor([2.0, 4.0, 6.0, 0.0, 2.0], dtype=torch.float64))
    assert torch.allclose(s.sample_probability("t_b"), i64([2, 1, 0, 1, 0, 2, 0, 2]).double() / 6)
    report = s.report()
    assert len(report.splitlines()) == 1 + len(TABLES)
    assert "t_b" in report and "lookups" in report


def test_from_batches_accepts_batch_objects_and_generators() -> None:
    class FakeBatch:
        def __init__(self, k: KeyedJaggedTensor) -> None:
            self.sparse_features = k

    a = AccessStats.from_batches((FakeBatch(k) for k in batches()), TABLES)
    assert a == AccessStats.from_batches(batches(), TABLES)


def test_bad_id_error_names_table_feature_and_id() -> None:
    bad = kjt({"fa": [[1], [2]], "fb1": [[0], [1]], "fb2": [[3], [8]]})
    with pytest.raises(ValueError) as e:
        AccessStats.from_batches([batches()[1], bad], TABLES)
    assert str(e.value) == "batch 1: table 't_b' feature 'fb2': id 8 is outside [0, 8)"
    neg = kjt({"fa": [[-3], [2]]})
    with pytest.raises(ValueError) as e:
        AccessStats.from_batches([neg], TABLES)
    assert str(e.value) == "batch 0: table 't_a' feature 'fa': id -3 is outside [0, 5)"


def test_a_key_no_table_serves_is_left_uncounted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Training carries another module's features along, so planning takes the same batches: such a key
    is named in one warning, and the counts are those of the batches without it."""
    with caplog.at_level(logging.WARNING):
        got = AccessStats.from_batches([*batches()[:1], kjt({"fa": [[1]], "zz": [[0]]}), kjt({"zz": [[4]]})], TABLES)
    want = AccessStats.from_batches([*batches()[:1], kjt({"fa": [[1]]}), kjt({"fa": [[]]})], TABLES)
    assert got == want
    assert caplog.text.count("served by no table") == 1
    assert "KJT key(s) ['zz'] (from batch 1 on) are served by no table of this EBC; not counted" in caplog.text


def test_a_table_whose_features_never_appear_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        AccessStats.from_batches([kjt({"fa": [[1], [2]]})], TABLES)
    assert "feature(s) {'t_b': ['fb1', 'fb2']} of the tables never appear in the 1 sample batch(es)" in caplog.text


def test_empty_input_errors() -> None:
    with pytest.raises(ValueError, match="no batches"):
        AccessStats.from_batches([], TABLES)


def test_coverage_hand_case() -> None:
    s = AccessStats.from_batches(batches(), TABLES)
    # t_a counts [1, 2, 3, 0, 1] (7 lookups); t_b [2, 1, 0, 1, 0, 3, 0, 3] (10 lookups)
    assert s.coverage(0.2) == pytest.approx({"t_a": 3 / 7, "t_b": 6 / 10})  # ceil(1) and ceil(1.6) rows
    assert s.coverage(0.4) == pytest.approx({"t_a": 5 / 7, "t_b": 9 / 10})  # 2 rows; 4 rows: 3+3+2+1
    assert s.coverage_top_k(2) == pytest.approx({"t_a": 5 / 7, "t_b": 6 / 10})
    assert s.coverage_top_k(100) == pytest.approx({"t_a": 1.0, "t_b": 1.0})
    assert s.coverage_top_k(0) == {"t_a": 0.0, "t_b": 0.0}
    assert AccessStats.empty(TABLES).coverage() == {"t_a": 0.0, "t_b": 0.0}
    with pytest.raises(ValueError):
        s.coverage(0.0)


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_save_load_round_trip(tmp_path: Path, suffix: str) -> None:
    s = AccessStats.from_batches(batches(), TABLES)
    path = tmp_path / f"stats{suffix}"
    s.save(path)
    loaded = AccessStats.load(path)
    assert loaded == s
    for name in ("counts", "presence", "sample_counts"):
        for t in s.tables:
            assert torch.equal(getattr(loaded, name)[t], getattr(s, name)[t])
            assert getattr(loaded, name)[t].dtype == torch.int64
    assert (loaded.num_batches, loaded.num_samples, loaded.num_embeddings) == (3, 6, {"t_a": 5, "t_b": 8})
    assert AccessStats.from_json(s.to_json()) == s


def test_validate_mismatch_errors() -> None:
    s = AccessStats.from_batches(batches(), TABLES)
    s.validate(TABLES)
    with pytest.raises(ValueError) as e:
        s.validate([TABLES[0], table("t_b", 9, ["fb1", "fb2"])])
    assert str(e.value) == "table 't_b': the access stats have 8 rows but the model's table has 9"
    with pytest.raises(ValueError) as e:
        s.validate([TABLES[0], table("t_c", 8, ["fb1", "fb2"])])
    assert str(e.value) == "table 't_c' of the model is not in the access stats (stats tables: ['t_a', 't_b'])"
    with pytest.raises(ValueError) as e:
        s.validate([TABLES[0]])
    assert str(e.value) == "access stats tables ['t_b'] are not in the model (model tables: ['t_a'])"


def test_a_feature_two_tables_read_is_counted_for_each() -> None:
    """Two EBCs may read one KJT key (a two-tower model's shared feature): each table counts its accesses, as if
    it alone read it (it was refused as 'served by two tables')."""
    both = [table("user_geo_u", 5, ["geo"]), table("user_geo_i", 6, ["geo", "fi"])]
    s = AccessStats.from_batches([kjt({"geo": [[1, 1], [4]], "fi": [[5], []]})], both)
    assert torch.equal(s.counts["user_geo_u"], i64([0, 2, 0, 0, 1]))
    assert torch.equal(s.counts["user_geo_i"], i64([0, 2, 0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"batch 0: table 'user_geo_u' feature 'geo': id 5 is outside \[0, 5\)"):
        AccessStats.from_batches([kjt({"geo": [[5]], "fi": [[0]]})], both)
