"""Tests of the hot-row cost model: byte formulas, break-even sets, sync-mode choice, memory budget."""

import logging
import math
from typing import Dict, List, Optional, Sequence

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_herald.data import SyntheticCriteo
from torchrec_herald.data.base import kjt_from_ids
from torchrec_herald.model import build_tables
from torchrec_herald.planner.hot_set import (
    CostModelHotSetSelector,
    HotSetChoice,
    TableTraffic,
    TopFractionHotSetSelector,
    cold_bytes_breakdown,
    cold_lookup_bytes,
    dense_break_even_lookups,
    dense_sync_bytes,
    expected_cold_bytes,
    format_traffic_report,
    hot_row_bytes,
    sparse_sync_bytes,
    stock_row_wise_bytes,
    stock_table_wise_bytes,
    total_traffic,
    touch_probability,
)
from torchrec_herald.planner.stats import AccessStats

F64 = torch.float64


def cfg(name: str, n: int, dim: int = 16) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=n, feature_names=[f"f_{name}"])


def make_stats(tables: Sequence[EmbeddingBagConfig], counts: Dict[str, torch.Tensor], num_samples: int,
               sample_counts: Optional[Dict[str, torch.Tensor]] = None) -> AccessStats:
    """Hand-made stats: ``λ_x = counts_x · G / num_samples``; sample_counts default to counts (one id)."""
    return AccessStats(tables=[t.name for t in tables], num_embeddings={t.name: t.num_embeddings for t in tables},
                       feature_names={t.name: list(t.feature_names) for t in tables},
                       counts={k: v.long() for k, v in counts.items()}, num_batches=10, num_samples=num_samples,
                       sample_counts=None if sample_counts is None else {k: v.long() for k, v in sample_counts.items()})


# ---------------------------------------------------------------------- formulas by hand


def test_byte_formulas_hand_values() -> None:
    W, D = 4, 16
    assert cold_lookup_bytes(D) == 136  # 4 B id + 4 B length + 64 B pooled + 64 B grad
    assert hot_row_bytes(D) == 68  # 64 B weights + 4 B row-wise Adagrad
    lam = torch.tensor([10.0, 2.0], dtype=F64)
    assert expected_cold_bytes(lam, W, D) == 12 * 0.75 * 136 == 1224
    assert cold_bytes_breakdown(lam, W, D) == (72.0, 576.0, 576.0)
    assert dense_sync_bytes(5, W, D) == 2 * 3 * 5 * 64 == 1920
    assert sparse_sync_bytes(torch.tensor([0.5, 1.0], dtype=F64), W, D) == 4 * 3 * 68 * 1.5 == 1224
    # stock TABLE_WISE, one one-id feature: G·(W−1)/W·(12 + 8D); 26 such tables = 2730 KiB, the measured
    # all_to_all_single bytes of the 4-rank all-TABLE_WISE benchmark (benchmarks/RESULTS.md) minus splits
    assert stock_table_wise_bytes(1024, 1024, W, D) == 1024 * 0.75 * 140 == 107520
    assert stock_table_wise_bytes(1024, 1024, W, D) * 26 / 1024 == 2730.0
    # two features, 3 ids per (sample, feature): ids 8·L, lengths and vectors per (sample, feature)
    assert stock_table_wise_bytes(6 * 512, 512, 2, 8, num_features=2) == 0.5 * (8 * 3072 + 512 * 2 * (4 + 64))
    # stock ROW_WISE: reduce-scatter + all-gather 2(W−1)·G·4D, ids (W−1)/W·8·L, lengths (W−1)·G·4
    assert stock_row_wise_bytes(1024, 1024, W, D) == 2 * 3 * 1024 * 64 + 0.75 * 8 * 1024 + 3 * 1024 * 4 == 411648
    # 13 ROW_WISE tables at 2 ranks: 416 KiB reduce-scatter + 416 KiB all-gather + 52 KiB ids/lengths (measured)
    assert stock_row_wise_bytes(512, 512, 2, D) * 13 / 1024 == 416 + 416 + 52
    p = torch.tensor([0.0, 1 / 1024, 1.0], dtype=F64)
    assert torch.allclose(touch_probability(p, 256), torch.tensor([0.0, 1 - (1023 / 1024) ** 256, 1.0], dtype=F64),
                          rtol=1e-14, atol=0)
    assert dense_break_even_lookups(W, D) == pytest.approx(2 * 3 * 4 * D / (0.75 * (8 + 8 * D)))
    assert dense_break_even_lookups(1, D) == math.inf
    total = TableTraffic(lookups=3, hot_lookups=1, herald_cold_ids=1, herald_cold_pooled=2, herald_cold_grads=3,
                         herald_hot_sync=4)
    assert (total.herald_cold, total.herald_total, total.hot_lookup_share) == (6, 10, 1 / 3)
    assert (total + total).as_dict()["herald_total"] == 20


# ---------------------------------------------------------------------- break-even sets


def test_dense_hot_set_is_rows_above_analytic_break_even() -> None:
    W, B = 4, 256
    G = W * B
    tables = [cfg("t_x", 2000, dim=16), cfg("t_y", 1500, dim=8)]
    g = torch.Generator().manual_seed(0)
    counts = {t.name: (200 * torch.rand(t.num_embeddings, generator=g, dtype=F64) ** 4).floor().long() for t in tables}
    num_samples = 10 * G  # λ = counts / 10
    stats = make_stats(tables, counts, num_samples)
    choices = CostModelHotSetSelector().select(stats, tables, W, B, memory_budget_bytes=None)
    assert list(choices) == ["t_x", "t_y"]
    for t in tables:
        D = t.embedding_dim
        lam = counts[t.name].to(F64) * G / num_samples
        threshold = 2 * (W - 1) * 4 * D / ((W - 1) / W * (8 + 8 * D))  # dense λ*
        expected = torch.nonzero(lam > threshold).flatten()
        c = choices[t.name]
        assert c.sync == "dense"
        assert c.hot_ids.dtype == torch.int64 and torch.equal(c.hot_ids, expected)
        h = expected.numel()
        assert 0 < h < t.num_embeddings
        assert c.replica_bytes_per_rank == h * (4 * D + 4)
        cold_lam = lam.sum() - lam[expected].sum()
        e = c.expected
        assert e.herald_cold == pytest.approx(float(cold_lam) * (W - 1) / W * (8 + 8 * D), rel=1e-12)
        assert e.herald_hot_sync == 2 * (W - 1) * h * D * 4
        assert e.herald_total == pytest.approx(e.herald_cold + e.herald_hot_sync, rel=1e-15)
        assert e.cold_remote_lookups == pytest.approx(float(cold_lam) * (W - 1) / W, rel=1e-12)
        assert e.stock_table_wise == pytest.approx((W - 1) / W * (8 * float(lam.sum()) + G * (4 + 8 * D)), rel=1e-12)
        # ROW_WISE: partial pooled vectors and their gradients, (W - 1)·G·4D each way, ids and lengths
        assert e.stock_row_wise == pytest.approx(2 * (W - 1) * G * 4 * D + (W - 1) / W * 8 * float(lam.sum())
                                                 + (W - 1) * G * 4, rel=1e-12)
        assert e.herald_total < expected_cold_bytes(lam, W, D)  # better than no hot rows at all
    _check_traffic_report(choices)
    again = CostModelHotSetSelector().select(stats, tables, W, B, memory_budget_bytes=None)
    assert all(torch.equal(again[k].hot_ids, choices[k].hot_ids) for k in choices)  # deterministic


def _sparse_net(lam: torch.Tensor, p: torch.Tensor, W: int, B: int, D: int) -> torch.Tensor:
    saving = lam * (W - 1) / W * (8 + 8 * D)
    return saving - W * (W - 1) * (4 + 4 * D) * (1 - (1 - p) ** B)


def _dense_net(lam: torch.Tensor, W: int, D: int) -> torch.Tensor:
    return lam * (W - 1) / W * (8 + 8 * D) - 2 * (W - 1) * 4 * D


def test_sparse_sync_chosen_for_many_warm_rows() -> None:
    """W=2, one-id rows with λ ≤ 3: a touched row costs 2·68·P < its saving 68·λ, while dense pays only
    above λ* ≈ 1.88 — sparse wins and replicates the rows with positive sparse net benefit."""
    W, B, D = 2, 256, 16
    G = W * B
    t = cfg("t_w", 400, D)
    counts = torch.arange(400) % 31  # λ = counts / 10 in [0, 3]
    stats = make_stats([t], {"t_w": counts}, 10 * G)
    c = CostModelHotSetSelector().select(stats, [t], W, B, None)["t_w"]
    lam = counts.to(F64) / 10
    net = _sparse_net(lam, lam / G, W, B, D)
    assert c.sync == "sparse"
    assert torch.equal(c.hot_ids, torch.nonzero(net > 0).flatten())
    assert c.num_hot > int((_dense_net(lam, W, D) > 0).sum())  # more rows than dense would take
    P = 1 - (1 - lam[c.hot_ids] / G) ** B
    assert c.expected.herald_hot_sync == pytest.approx(float(W * (W - 1) * (4 + 4 * D) * P.sum()), rel=1e-12)
    assert c.expected.herald_hot_sync_allreduce == 0.0  # (an exchange: the model of time's all-to-all rate)


def test_sparse_sync_chosen_for_rows_repeated_within_bags() -> None:
    """W=4, each sample that looks a row up does so 10 times: λ is 10× the per-sample probability, so
    a replica saves 10 lookups per touch and sparse sync pays far below the dense break-even."""
    W, B, D = 4, 256, 16
    G = W * B
    t = cfg("t_r", 300, D)
    samples = torch.arange(300) % 5  # p = samples / (10·G) ⇒ λ = samples·10 / 10 = samples ≤ 4
    counts = samples * 10
    stats = make_stats([t], {"t_r": counts}, 10 * G, sample_counts={"t_r": samples})
    c = CostModelHotSetSelector().select(stats, [t], W, B, None)["t_r"]
    lam, p = counts.to(F64) / 10, samples.to(F64) / (10 * G)
    net = _sparse_net(lam, p, W, B, D)
    assert c.sync == "sparse"
    assert torch.equal(c.hot_ids, torch.nonzero(net > 0).flatten())
    assert torch.equal(c.hot_ids, torch.nonzero(samples > 0).flatten())
    assert float(_dense_net(lam, W, D).clamp(min=0).sum()) < float(net.clamp(min=0).sum())


def _check_traffic_report(choices: Dict[str, HotSetChoice]) -> None:
    """``format_traffic_report``'s rows carry each choice's figures in their columns, and its last line the
    totals and herald's share of TABLE_WISE's bytes."""
    lines = format_traffic_report(choices).splitlines()
    assert lines[0].split() == ["table", "hot", "sync", "replica", "KiB", "local", "%", "stock", "TW", "stock", "RW",
                                "herald", "cold", "sync", "B"]
    for line, c in zip(lines[1:], choices.values()):
        e = c.expected
        assert line.split() == [c.table, str(c.num_hot), c.sync, f"{c.replica_bytes_per_rank / 1024:.1f}",
                                f"{e.hot_lookup_share * 100:.1f}"] + [f"{v:.0f}" for v in (
                                    e.stock_table_wise, e.stock_row_wise, e.herald_total, e.herald_cold,
                                    e.herald_hot_sync)], line
    tw = sum(c.expected.stock_table_wise for c in choices.values())
    rw = sum(c.expected.stock_row_wise for c in choices.values())
    herald = sum(c.expected.herald_total for c in choices.values())
    t = total_traffic(choices)
    assert lines[len(choices) + 1].split() == [
        "total", str(sum(c.num_hot for c in choices.values())),
        f"{sum(c.replica_bytes_per_rank for c in choices.values()) / 1024:.1f}", f"{t.hot_lookup_share * 100:.1f}",
        f"{tw:.0f}", f"{rw:.0f}", f"{herald:.0f}", f"{t.herald_cold:.0f}", f"{t.herald_hot_sync:.0f}"]
    assert lines[-1] == (f"expected bytes/step (all ranks): stock TABLE_WISE {tw:.0f}, stock ROW_WISE {rw:.0f}, "
                         f"herald {herald:.0f} ({herald / tw * 100:.1f} % of TABLE_WISE)")


def test_dense_sync_chosen_for_few_very_hot_rows() -> None:
    """W=2: a row touched by every rank costs 2·68 B sparse vs 2·64 B dense."""
    W, B, D = 2, 256, 16
    G = W * B
    t = cfg("t_h", 50, D)
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[3, 17, 40]] = torch.tensor([5000, 3000, 2000])  # λ = 500, 300, 200 per step: P ≈ 1
    stats = make_stats([t], {"t_h": counts}, 10 * G)
    c = CostModelHotSetSelector().select(stats, [t], W, B, None)["t_h"]
    assert c.sync == "dense" and c.hot_ids.tolist() == [3, 17, 40]
    assert c.expected.herald_hot_sync == c.expected.herald_hot_sync_allreduce == 3 * 2 * (W - 1) * 4 * D
    assert c.expected.herald_cold == 0 and c.expected.hot_lookup_share == 1.0
    _check_traffic_report({"t_h": c})


def test_no_benefit_gives_empty_hot_set() -> None:
    W, B = 4, 256
    t = cfg("t_c", 100)
    stats = make_stats([t], {"t_c": torch.ones(100, dtype=torch.int64)}, 10 * W * B)  # λ = 0.1
    c = CostModelHotSetSelector().select(stats, [t], W, B, 1 << 20)["t_c"]
    assert c.sync == "none" and c.num_hot == 0 and c.replica_bytes_per_rank == 0
    assert c.expected.herald_hot_sync == 0
    assert c.expected.herald_total == pytest.approx(expected_cold_bytes(torch.full((100,), 0.1, dtype=F64), W, 16))
    one = CostModelHotSetSelector().select(stats, [t], 1, B, None)["t_c"]  # one rank: nothing is remote
    assert one.num_hot == 0 and one.expected.herald_total == 0 and one.expected.stock_table_wise == 0


# ---------------------------------------------------------------------- memory budget


def _two_dense_tables(W: int, B: int) -> tuple:
    tables = [cfg("t_a", 300), cfg("t_b", 200)]
    g = torch.Generator().manual_seed(1)
    # distinct λ ≥ 4 > λ* on every row (all rows profitable, dense), interleaved across the two tables
    perm = torch.randperm(500, generator=g)
    counts = {"t_a": 40 + 3 * perm[:300], "t_b": 40 + 3 * perm[300:]}
    return tables, counts, make_stats(tables, counts, 10 * W * B)


@pytest.mark.parametrize("k", [1, 7, 40])
def test_budget_for_k_rows_keeps_the_k_best(k: int) -> None:
    W, B = 4, 256
    tables, counts, stats = _two_dense_tables(W, B)
    unlimited = CostModelHotSetSelector().select(stats, tables, W, B, None)
    assert sum(c.num_hot for c in unlimited.values()) == 500
    allc = torch.cat([counts["t_a"], counts["t_b"]])
    best = torch.topk(allc, k).indices  # same D: best net per byte = largest λ
    expect = {"t_a": torch.sort(best[best < 300]).values, "t_b": torch.sort(best[best >= 300] - 300).values}
    for budget in (k * 68, k * 68 + 67):
        choices = CostModelHotSetSelector().select(stats, tables, W, B, budget)
        assert sum(c.num_hot for c in choices.values()) == k
        assert sum(c.replica_bytes_per_rank for c in choices.values()) == k * 68
        for name in ("t_a", "t_b"):
            assert torch.equal(choices[name].hot_ids, expect[name])
            assert choices[name].sync == ("dense" if expect[name].numel() else "none")


def test_budget_greedy_fill_skips_rows_that_do_not_fit() -> None:
    """Rows in descending net per byte: A0 (260 B) fits, A1 does not, B's 20 B rows still do."""
    W, B = 4, 256
    tables = [cfg("A", 4, dim=64), cfg("B", 6, dim=4)]
    counts = {"A": torch.tensor([1000, 900, 0, 0]), "B": torch.tensor([500, 490, 480, 470, 0, 0])}
    stats = make_stats(tables, counts, 10 * W * B)
    assert (hot_row_bytes(64), hot_row_bytes(4)) == (260, 20)
    choices = CostModelHotSetSelector().select(stats, tables, W, B, 260 + 3 * 20 + 10)
    assert choices["A"].hot_ids.tolist() == [0]
    assert choices["B"].hot_ids.tolist() == [0, 1, 2]


@pytest.mark.parametrize("budget", [0, 67])
def test_budget_below_one_row_empties_every_table(budget: int, caplog: pytest.LogCaptureFixture) -> None:
    W, B = 4, 256
    tables, counts, stats = _two_dense_tables(W, B)
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.planner.hot_set"):
        choices = CostModelHotSetSelector().select(stats, tables, W, B, budget)
    for name, c in choices.items():
        assert c.num_hot == 0 and c.sync == "none" and c.replica_bytes_per_rank == 0
        lam = counts[name].to(F64) / 10
        assert c.expected.herald_total == pytest.approx(expected_cold_bytes(lam, W, 16), rel=1e-12)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert msg.startswith(f"planner.hot_memory_budget_bytes: a budget of {budget} B per rank is smaller than one "
                          "hot row (68 B, the smallest budget that replicates any row)"), msg
    assert "a herald plan with no hot rows" in msg and "stock" not in msg


def test_top_fraction_baseline() -> None:
    W, B = 4, 256
    tables, counts, stats = _two_dense_tables(W, B)
    choices = TopFractionHotSetSelector(0.02).select(stats, tables, W, B, None)
    for t in tables:
        k = math.ceil(0.02 * t.num_embeddings)
        c = choices[t.name]
        assert c.sync == "dense" and c.num_hot == k
        assert torch.equal(c.hot_ids, torch.sort(torch.topk(counts[t.name], k).indices).values)
    sparse = TopFractionHotSetSelector(0.02, sync="sparse").select(stats, tables, W, B, None)
    assert all(c.sync == "sparse" for c in sparse.values())
    with pytest.raises(ValueError):
        HotSetChoice(table="x", hot_ids=torch.tensor([1]), sync="none", replica_bytes_per_rank=68)


def test_selector_validates_stats_against_tables() -> None:
    W, B = 4, 256
    tables, _, stats = _two_dense_tables(W, B)
    with pytest.raises(ValueError, match="the access stats have 300 rows but the model's table has 301"):
        CostModelHotSetSelector().select(stats, [cfg("t_a", 301), tables[1]], W, B, None)


# ---------------------------------------------------------------------- default synthetic data


def test_synthetic_criteo_prediction_beats_table_wise() -> None:
    ds = SyntheticCriteo()
    tables = build_tables(ds.feature_names, ds.num_embeddings, 16)
    kjts = [kjt_from_ids(ds.feature_names, ds.global_batch("train", i, 1024)[1]) for i in range(20)]
    stats = AccessStats.from_batches(kjts, tables)
    assert stats.num_samples == 20 * 1024
    budget = 64 << 20
    lines: List[str] = []
    for W in (2, 4):
        B = 256
        choices = CostModelHotSetSelector().select(stats, tables, W, B, budget)
        total = total_traffic(choices)
        lines.append(f"W={W} B={B}:\n{format_traffic_report(choices)}")
        assert total.herald_total < total.stock_table_wise
        assert sum(c.replica_bytes_per_rank for c in choices.values()) <= budget
        if W == 4:
            assert total.stock_table_wise == 26 * 107520
            base = total_traffic(TopFractionHotSetSelector(0.02).select(stats, tables, W, B, budget))
            assert total.herald_total < base.herald_total  # the cost model beats a fixed top-2 %
    print("\n".join(lines))
