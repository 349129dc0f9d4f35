"""Synthetic Criteo-like data: a deterministic, skewed, learnable generator calibrated to Criteo Kaggle.

Layout: 13 dense + 26 one-hot sparse features (``cat_0`` .. ``cat_25``) whose tables have the Criteo
Kaggle cardinalities scaled by ``scale`` (:func:`~torchrec_herald.data.base.scaled_num_embeddings`).

Skew: in table ``f`` the id of popularity rank ``k`` (0-based) is drawn with probability
``(k + 1) ** -zipf_alpha / H`` (a truncated Zipf law); ranks are mapped to row ids through a fixed,
seeded random permutation per table, so hot rows are scattered over the row range like hashed ids.
Ids are sampled by inverse CDF (an upper-bound search on a precomputed CDF: herald's compiled module
where it is built, else ``torch.searchsorted``, with the same rows).

Coverage (the skew statistic the default ``zipf_alpha`` is calibrated on): rank all rows of the
tables with at least ``CALIBRATION_MIN_ROWS`` (1000) rows together by expected lookup frequency and
take the share of their lookups that hit the top ``top_fraction`` of those rows. At scale 0.01 these
7 tables hold 99.5 % of all rows; the 19 small ones (many padded to 16 rows) are left out because
every one of their rows would count as "hot" and inflate the figure (over all 26 tables the same
alpha gives ~97 %). :func:`global_coverage` computes it analytically (``min_rows=0``: all tables);
:func:`measured_coverage` measures it on generated KJTs (ranking rows by observed counts).
``DEFAULT_ZIPF_ALPHA`` = 1.22 makes the top 2 % of the large tables' rows cover ~90 % of their
lookups at the default scale 0.01 (:func:`calibrate_zipf_alpha` gives 1.219 for exactly 0.90),
close to the alpha = 1.2 per-table Zipf law docs/design.md §3's trace model uses.

Labels: ``label ~ Bernoulli(sigmoid(w . (dense - c) + sum_f v_f[id_f] + b))`` with fixed seeded
dense weights ``w ~ N(0, 0.25^2)``, per-row effects ``v_f ~ N(0, 0.22^2)`` (shifted per table to
zero mean over lookups), ``c`` the mean dense vector and ``b = -1.3``: ~27 % clicks, Bayes (oracle)
AUC ~0.78 (seed 0), and a plain per-feature logistic model already reaches ~0.75 eval AUC after
one pass over the 200 default train batches of 512. Dense features are ``log1p`` of nonnegative,
log-normally skewed integer counts (like Criteo's).

Determinism: global batch ``i`` of split ``s`` comes from a generator seeded by ``(seed, s, i)``,
so every run and every rank sees the same global batches, and train and eval streams differ.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_herald.data.base import (
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    DataSource,
    check_start,
    global_batch_size,
    kjt_from_ids,
    scaled_num_embeddings,
)

logger = logging.getLogger(__name__)

#: Tables smaller than this take no part in the skew calibration: their "top 2 %" is under 20 rows,
#: and at scale 0.01 the 16-row floor of tiny tables would make every one of their rows "hot".
CALIBRATION_MIN_ROWS = 1000
#: Calibrated with ``calibrate_zipf_alpha(scaled_num_embeddings(0.01), 0.02, 0.90)`` (rounded).
DEFAULT_ZIPF_ALPHA = 1.22
#: Std of the per-row label effects v_f and of the dense weights w; bias of the logit.
ROW_EFFECT_STD, DENSE_WEIGHT_STD, LOGIT_BIAS = 0.22, 0.25, -1.3


def zipf_probs(num_rows: int, alpha: float) -> torch.Tensor:
    """Lookup probability of each popularity rank ``k`` of a table, ``∝ (k + 1) ** -alpha`` (float64)."""
    p = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-alpha)
    return p / p.sum()


def table_coverage(num_rows: int, alpha: float, top_fraction: float) -> float:
    """Analytical share of one table's lookups hitting its ``ceil(top_fraction * num_rows)`` hottest rows."""
    return zipf_probs(num_rows, alpha)[: math.ceil(top_fraction * num_rows)].sum().item()


def global_coverage(num_embeddings: Sequence[int], alpha: float, top_fraction: float, min_rows: int = 0) -> float:
    """Analytical share of all lookups hitting the hottest ``top_fraction`` of all rows of all tables
    (only tables with at least ``min_rows`` rows take part)."""
    sizes = [n for n in num_embeddings if n >= min_rows]
    freq = torch.cat([zipf_probs(n, alpha) for n in sizes]) / len(sizes)
    k = math.ceil(top_fraction * freq.numel())
    return freq.topk(k).values.sum().item()


def measured_coverage(
    kjts: Sequence[KeyedJaggedTensor], num_embeddings: Sequence[int], top_fraction: float, min_rows: int = 0
) -> Tuple[Dict[str, float], float]:
    """Coverage measured on KJTs: ``({key: per-table coverage}, global coverage)``.

    Rows are ranked by their observed lookup counts; the per-table value is the share of a table's
    lookups hitting its ``ceil(top_fraction * rows)`` most looked-up rows, the global one the share
    of all lookups hitting the ``ceil(top_fraction * total_rows)`` most looked-up rows of all tables
    with at least ``min_rows`` rows.
    """
    keys = kjts[0].keys()
    counts = [torch.zeros(n, dtype=torch.float64) for n in num_embeddings]
    for kjt in kjts:
        for f, jt in enumerate(kjt.split([1] * len(keys))):
            counts[f] += torch.bincount(jt.values(), minlength=num_embeddings[f]).double()
    per_table = {
        key: (c.topk(math.ceil(top_fraction * c.numel())).values.sum() / c.sum().clamp(min=1)).item()
        for key, c in zip(keys, counts)
    }
    allc = torch.cat([c for c, n in zip(counts, num_embeddings) if n >= min_rows])
    top = allc.topk(math.ceil(top_fraction * allc.numel())).values.sum()
    return per_table, (top / allc.sum().clamp(min=1)).item()


def calibrate_zipf_alpha(
    num_embeddings: Sequence[int], top_fraction: float = 0.02, target: float = 0.90, tol: float = 1e-4,
    min_rows: int = CALIBRATION_MIN_ROWS,
) -> float:
    """Bisect the ``alpha`` whose analytical :func:`global_coverage` over the tables of at least
    ``min_rows`` rows equals ``target``."""
    lo, hi = 0.0, 4.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        cov = global_coverage(num_embeddings, mid, top_fraction, min_rows)
        lo, hi = (mid, hi) if cov < target else (lo, mid)
    return (lo + hi) / 2


def _seed(*parts: object) -> int:
    """A 63-bit generator seed derived from ``parts`` (stable across runs and platforms)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _InverseCdfSampler:
    """The tables' sampling model and inverse-CDF sampling of every table at once:
    ``(u [T, G] uniforms) -> (ids [T, G], flat [T, G])``, ``ids[f]`` the rows of table ``f``
    (``perm_f[upper_bound(cdf_f, u[f])]``, clamped to the last row) and ``flat`` the same rows numbered
    across the concatenated tables; :meth:`add_effects` adds the rows' label effects to the logits table
    by table.

    Each table's CDF, permutation and row effects are views of one buffer each (the compiled module reads
    them whole; no second copy: at full Criteo Kaggle size they hold 33.8 M rows). herald's compiled
    module samples and adds in one pass each without data-dependent branches (written by hand:
    ``torch.searchsorted``'s binary search mispredicts about once a level on random draws, ~40 % of a
    scheduling rank's batch reading). Where it is not built, the torch ops give the same rows and sums.
    """

    def __init__(self, num_rows: Sequence[int], zipf_alpha: float, g: torch.Generator) -> None:
        from torchrec_herald import native

        sizes = list(num_rows)
        self._bounds = torch.tensor([0] + sizes).cumsum(0)
        self._offsets = self._bounds[:-1].unsqueeze(1)  # table f's first row in the concatenated tables
        self._cdf = torch.empty(sum(sizes), dtype=torch.float64)
        self._perm = torch.empty(sum(sizes), dtype=torch.int64)  # each table's own row numbers
        self._effects = torch.empty(sum(sizes), dtype=torch.float32)
        self.cdfs, self.perms, self.effects = (list(t.split(sizes)) for t in (self._cdf, self._perm, self._effects))
        for n, cdf in zip(sizes, self.cdfs):
            cdf.copy_(zipf_probs(n, zipf_alpha).cumsum_(0))
        for n, perm in zip(sizes, self.perms):  # every permutation, then every table's effects: the draws' order
            perm.copy_(torch.randperm(n, generator=g))
        for n, cdf, perm, effects in zip(sizes, self.cdfs, self.perms, self.effects):
            v = torch.randn(n, generator=g, dtype=torch.float64) * ROW_EFFECT_STD
            probs = torch.diff(cdf, prepend=cdf.new_zeros(1))
            effects.copy_((v - probs @ v[perm]).float())  # zero mean per lookup
        self._native = native.load_if_built()

    def __call__(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._native is not None:
            flat = self._native.inverse_cdf_rows(u, self._cdf, self._bounds, self._perm)
            return flat - self._offsets, flat
        ids = torch.stack([
            perm[torch.searchsorted(cdf, u[f], right=True).clamp_(max=len(cdf) - 1)]
            for f, (cdf, perm) in enumerate(zip(self.cdfs, self.perms))
        ])  # fmt: skip
        return ids, ids + self._offsets

    def add_effects(self, logits: torch.Tensor, flat: torch.Tensor, present: Optional[torch.Tensor]) -> None:
        """``logits += effects_f[ids[f]]`` (times ``present[f]``) for each table ``f``, in table order (a
        sum over the tables at once may round otherwise)."""
        if self._native is not None:
            self._native.add_row_effects_(logits, self._effects, flat, present if present is not None
                                          else torch.empty(0, dtype=torch.bool))
            return
        effects = self._effects[flat] if present is None else self._effects[flat] * present
        for row in effects:
            logits += row


#: what the generator holds a row, every table, on every rank: a float64 CDF, an int64 permutation, a float32 effect
GENERATOR_BYTES_PER_ROW = 8 + 8 + 4


def host_memory_bytes() -> int:
    """This host's physical memory (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class SyntheticCriteo(DataSource):
    """Deterministic Criteo-Kaggle-like generator (see the module docstring for the model).

    Args:
        seed: seeds the tables (permutations, row effects, dense model) and every batch.
        scale: Criteo Kaggle cardinalities are scaled by this (``scaled_num_embeddings``).
        zipf_alpha: exponent of the per-table Zipf popularity law.
        num_train_batches / num_eval_batches: number of *global* batches per pass.
        missing_rate: probability that a feature's bag is empty for a sample.
    """

    def __init__(
        self,
        seed: int = 0,
        scale: float = 0.01,
        zipf_alpha: float = DEFAULT_ZIPF_ALPHA,
        num_train_batches: int = 1000,
        num_eval_batches: int = 20,
        missing_rate: float = 0.0,
    ) -> None:
        if not zipf_alpha >= 0 or math.isinf(zipf_alpha):  # (NaN fails the first test)
            raise ValueError(f"zipf_alpha must be a finite number >= 0, got {zipf_alpha}")
        if not 0.0 <= missing_rate < 1.0:
            raise ValueError(f"missing_rate must be in [0, 1), got {missing_rate}")
        if num_train_batches < 0 or num_eval_batches < 0:
            raise ValueError("num_train_batches and num_eval_batches must be >= 0")
        self.seed, self.scale, self.zipf_alpha = int(seed), float(scale), float(zipf_alpha)
        self.num_train_batches, self.num_eval_batches = int(num_train_batches), int(num_eval_batches)
        self.missing_rate = float(missing_rate)
        self.feature_names: List[str] = list(DEFAULT_CAT_NAMES)
        self.num_embeddings: List[int] = scaled_num_embeddings(self.scale)
        self.num_dense: int = INT_FEATURE_COUNT
        #: what the generator holds on each rank (the trainer's check of the tables against the host's memory counts it)
        self.generator_bytes: int = GENERATOR_BYTES_PER_ROW * sum(self.num_embeddings)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # (the ranks of this host each hold one)
        need, host = GENERATOR_BYTES_PER_ROW * sum(self.num_embeddings) * ranks, host_memory_bytes()
        if host and need > host:  # (it would fail in an allocation of its own, naming no key)
            raise ValueError(f"scale={self.scale:g} gives {sum(self.num_embeddings):,} rows in all; the synthetic "
                             f"generator holds {GENERATOR_BYTES_PER_ROW} bytes a row on each of this host's {ranks} "
                             f"rank(s) ({need / 2**30:,.1f} GiB), more than its {host / 2**30:,.1f} GiB: lower it (1.0 is "
                             f"Criteo Kaggle's size)")

        g = torch.Generator().manual_seed(_seed(self.seed, "model"))
        self._sampler = _InverseCdfSampler(self.num_embeddings, self.zipf_alpha, g)
        self._dense_mu = torch.rand(self.num_dense, generator=g) * 3.0
        self._dense_sigma = 0.5 + torch.rand(self.num_dense, generator=g)
        self._dense_w = torch.randn(self.num_dense, generator=g) * DENSE_WEIGHT_STD
        self._dense_center = self._dense(torch.randn(4096, self.num_dense, generator=g)).mean(0)
        logger.info(
            "SyntheticCriteo(seed=%d): %d tables, %d rows, zipf_alpha=%g, missing_rate=%g",
            self.seed, len(self.num_embeddings), sum(self.num_embeddings), self.zipf_alpha, self.missing_rate,
        )  # fmt: skip

    def _dense(self, z: torch.Tensor) -> torch.Tensor:
        """Dense features from standard normals: log1p of log-normal integer counts."""
        return torch.log1p(torch.floor(torch.exp(self._dense_mu + self._dense_sigma * z)))

    def coverage(self, top_fraction: float = 0.02, min_rows: int = CALIBRATION_MIN_ROWS
                 ) -> Tuple[Dict[str, float], float]:
        """Analytical ``({feature: per-table coverage}, coverage over the tables of >= min_rows rows)``."""
        per_table = {
            key: table_coverage(n, self.zipf_alpha, top_fraction)
            for key, n in zip(self.feature_names, self.num_embeddings)
        }
        return per_table, global_coverage(self.num_embeddings, self.zipf_alpha, top_fraction, min_rows)

    def oracle_logits(self, batch: Batch) -> torch.Tensor:
        """The true click logits of a generated batch (for Bayes-AUC checks)."""
        logits = (batch.dense_features - self._dense_center) @ self._dense_w + LOGIT_BIAS
        for f, jt in enumerate(batch.sparse_features.split([1] * len(self.feature_names))):
            sample = torch.repeat_interleave(torch.arange(len(logits)), jt.lengths().long())
            logits.index_add_(0, sample, self._sampler.effects[f][jt.values()])
        return logits

    def global_batch(
        self, split: str, index: int, size: int, rows: slice = slice(None)
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Generate global batch ``index`` of ``split`` with ``size`` samples; ``rows``: only these samples
        (a rank's slice: the same values as slicing the whole batch, at a fraction of the cost).

        Returns ``(dense [G, 13], ids [26, G], present [26, G] or None, labels [G])`` (G: the samples of
        ``rows``).
        """
        g = torch.Generator().manual_seed(_seed(self.seed, split, index))
        tables = len(self.num_embeddings)
        dense = self._dense(torch.randn(size, self.num_dense, generator=g))
        u = torch.rand(tables, size, generator=g, dtype=torch.float64)[:, rows]
        ids, flat = self._sampler(u)
        present = None
        if self.missing_rate > 0:
            present = (torch.rand(tables, size, generator=g) >= self.missing_rate)[:, rows]
        # the dense part of the logits over the whole batch, then sliced: one matrix-vector product per
        # batch whatever the slice, so a slice's labels are bit for bit the whole batch's
        logits = ((dense - self._dense_center) @ self._dense_w + LOGIT_BIAS)[rows]
        self._sampler.add_effects(logits, flat, present)
        labels = (torch.rand(size, generator=g)[rows] < torch.sigmoid(logits)).float()
        return dense[rows].contiguous(), ids, present, labels

    def _batches(self, split: str, num: int, rank: int, world_size: int, batch_size: int,
                 start: int = 0) -> Iterator[Batch]:
        size = global_batch_size(rank, world_size, batch_size)
        mine = slice(rank * batch_size, (rank + 1) * batch_size)
        for i in range(start, num):
            dense, ids, present, labels = self.global_batch(split, i, size, mine)
            yield Batch(dense_features=dense, sparse_features=kjt_from_ids(self.feature_names, ids, present),
                        labels=labels)

    def train_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """``num_train_batches`` global batches of the train stream, this rank's slice of each."""
        return self._batches("train", self.num_train_batches, rank, world_size, batch_size)

    def train_batches_from(self, rank: int, world_size: int, batch_size: int, start: int) -> Iterator[Batch]:
        """:meth:`train_batches` from global batch ``start``: each batch is seeded by its index, so the
        first ``start`` are skipped without being generated."""
        return self._batches("train", self.num_train_batches, rank, world_size, batch_size, check_start(start))

    def eval_batches(self, rank: int, world_size: int, batch_size: int, pad_tail: bool = False) -> Iterator[Batch]:
        """``num_eval_batches`` global batches of the (independent) eval stream (whole ones: ``pad_tail`` has
        nothing to pad)."""
        return self._batches("eval", self.num_eval_batches, rank, world_size, batch_size)
