"""Per-row embedding access statistics, the input of the hot-row cost model (:mod:`.hot_set`).

P²RES (He, Chen, Zhai, PPoPP'24 poster) replicates the few frequently accessed rows on every rank;
its performance model picks them from access counts sampled over ~100 batches, as these stats do.

An :class:`AccessStats` holds, per embedding table (a table may serve several KJT features):

* ``counts[t][x]`` — how many times row ``x`` was looked up (every id of every bag of every feature
  served by ``t``; an id repeated in one bag counts each time);
* ``sample_counts[t][x]`` — in how many samples row ``x`` appears at least once (over all features
  of ``t``); equals ``counts`` for one-id features. ``sample_counts / num_samples`` is the per-sample
  lookup probability ``p_x`` of the cost model;
* ``presence[t][x]`` — in how many sampled batches row ``x`` appears at least once (the poster's
  frequency statistic);

plus ``num_batches`` and ``num_samples`` (sum of the KJT strides). Everything is exact integer counting
(int64); the derived rates are float64.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

__all__ = ["AccessStats"]

#: identifies files written by :meth:`AccessStats.save`
_FORMAT = "torchrec_herald.AccessStats"
_VERSION = 1
_COUNTERS = ("counts", "sample_counts", "presence")

PathLike = Union[str, "os.PathLike[str]"]


def _table_layout(tables: Sequence[EmbeddingBagConfig]) -> Tuple[List[str], Dict[str, int], Dict[str, List[str]]]:
    """(table names in order, rows per table, features per table); rejects duplicate table names. A feature may
    be served by several tables (two EBCs reading one KJT key): each counts its accesses."""
    names: List[str] = []
    rows: Dict[str, int] = {}
    features: Dict[str, List[str]] = {}
    for cfg in tables:
        if cfg.name in rows:
            raise ValueError(f"duplicate table name {cfg.name!r}")
        if cfg.num_embeddings < 1:
            raise ValueError(f"table {cfg.name!r}: num_embeddings must be >= 1, got {cfg.num_embeddings}")
        names.append(cfg.name)
        rows[cfg.name] = int(cfg.num_embeddings)
        features[cfg.name] = list(cfg.feature_names)
    return names, rows, features


@dataclass(eq=False)
class AccessStats:
    """Per-row lookup statistics of a set of embedding tables (see the module docstring).

    Build it with :meth:`from_batches`; the constructor is for hand-made or loaded stats.
    ``sample_counts`` defaults to ``counts`` (exact for one-id features) and ``presence`` to zeros.

    Attributes:
        tables: table names, in model order.
        num_embeddings: rows of each table.
        feature_names: KJT features served by each table.
        counts: int64 ``[num_embeddings]`` lookups of each row.
        sample_counts: int64 ``[num_embeddings]`` samples in which each row appears at least once.
        presence: int64 ``[num_embeddings]`` sampled batches in which each row appears at least once.
        num_batches: number of sampled batches (KJTs).
        num_samples: number of sampled samples (sum of the KJT strides).
    """

    tables: List[str]
    num_embeddings: Dict[str, int]
    feature_names: Dict[str, List[str]]
    counts: Dict[str, torch.Tensor]
    num_batches: int
    num_samples: int
    sample_counts: Optional[Dict[str, torch.Tensor]] = None
    presence: Optional[Dict[str, torch.Tensor]] = None

    def __post_init__(self) -> None:
        self.tables = list(self.tables)
        self.num_embeddings = {t: int(n) for t, n in self.num_embeddings.items()}
        self.feature_names = {t: list(f) for t, f in self.feature_names.items()}
        self.counts = dict(self.counts)
        self.sample_counts = dict(self.sample_counts or {})
        self.presence = dict(self.presence or {})
        self.num_batches, self.num_samples = int(self.num_batches), int(self.num_samples)
        if self.num_batches < 0 or self.num_samples < 0:
            raise ValueError("num_batches and num_samples must be >= 0")
        for t in self.tables:
            n = self.num_embeddings[t]
            for name in _COUNTERS:
                store: Dict[str, torch.Tensor] = getattr(self, name)
                if t not in store:
                    if name == "counts":
                        raise ValueError(f"table {t!r}: no counts")
                    store[t] = self.counts[t].clone() if name == "sample_counts" else torch.zeros(n, dtype=torch.int64)
                c = torch.as_tensor(store[t]).to("cpu", torch.int64).clone()  # owned: update() adds in place
                if c.shape != (n,):
                    raise ValueError(f"table {t!r}: {name} has shape {tuple(c.shape)}, expected ({n},)")
                store[t] = c
        extra = set(self.counts) - set(self.tables)
        if extra:
            raise ValueError(f"counts for unknown tables {sorted(extra)}")

    # ------------------------------------------------------------------ building

    @classmethod
    def empty(cls, tables: Sequence[EmbeddingBagConfig]) -> "AccessStats":
        """Zero statistics for ``tables`` (nothing sampled yet)."""
        names, rows, features = _table_layout(tables)
        # the counters are fresh and well-formed: set them directly rather than through __post_init__,
        # which would copy every one of them (3 x 8 B per row, about 0.8 GB at full Criteo Kaggle size)
        stats = cls.__new__(cls)
        stats.tables, stats.num_embeddings, stats.feature_names = names, rows, features
        stats.num_batches, stats.num_samples = 0, 0
        for name in _COUNTERS:
            setattr(stats, name, {t: torch.zeros(rows[t], dtype=torch.int64) for t in names})
        return stats

    @classmethod
    def from_batches(cls, batches: Iterable[KeyedJaggedTensor], tables: Sequence[EmbeddingBagConfig]
                     ) -> "AccessStats":
        """Count the lookups of every row of ``tables`` in ``batches``.

        Args:
            batches: ``KeyedJaggedTensor`` s (a ``torchrec.datasets.utils.Batch`` is accepted too:
                its ``sparse_features`` are used). Each KJT is one sampled batch; its stride is its
                number of samples. Keys may be any subset of the tables' features.
            tables: the model's table configs; a table serves every feature in ``feature_names``.

        Raises:
            ValueError: an id outside ``[0, num_embeddings)``
                (the message names the batch, table, feature and the first bad id); no batches.
        """
        stats = cls.empty(tables)
        unserved: Dict[str, int] = {}  # key -> the first batch holding it
        seen: set = set()
        for kjt in batches:
            index = stats.num_batches
            for key in stats.update(kjt):
                unserved.setdefault(key, index)
            seen.update(getattr(kjt, "sparse_features", kjt).keys())
        if stats.num_batches == 0:
            raise ValueError("AccessStats.from_batches: no batches")
        if unserved:  # another module's features (training carries them along): said once, not counted
            logger.warning("AccessStats: KJT key(s) %s (from batch %d on) are served by no table of this EBC; not "
                           "counted", sorted(unserved), min(unserved.values()))
        unseen = {t: [f for f in fs if f not in seen] for t, fs in stats.feature_names.items()}
        unseen = {t: fs for t, fs in unseen.items() if fs}
        if unseen:
            logger.warning("AccessStats: feature(s) %s of the tables never appear in the %d sample batch(es): "
                           "those tables' rows count no access (no hot rows)", unseen, stats.num_batches)
        return stats

    def update(self, batch: Any) -> List[str]:
        """Add one sampled batch (a ``KeyedJaggedTensor`` or a ``Batch``) to the counts; returns its keys that
        no table serves (another module's features, left uncounted)."""
        kjt: KeyedJaggedTensor = getattr(batch, "sparse_features", batch)
        index = self.num_batches
        if kjt.variable_stride_per_key():
            raise ValueError(f"batch {index}: variable-stride (VBE) KJTs are not supported")
        feature_tables: Dict[str, List[str]] = {}  # (a KJT key two EBCs read: each table counts it)
        for t in self.tables:
            for f in self.feature_names[t]:
                feature_tables.setdefault(f, []).append(t)
        stride = int(kjt.stride())
        unserved = [key for key in kjt.keys() if key not in feature_tables]
        if unserved:
            kjt = kjt.permute([i for i, key in enumerate(kjt.keys()) if key in feature_tables])
        keys = kjt.keys()
        values = kjt.values().detach().to("cpu", torch.int64)
        lengths = kjt.lengths().detach().to("cpu", torch.int64)
        per_key_values = values.split(kjt.length_per_key())
        per_key_lengths = lengths.split([stride] * len(keys))
        # gather the ids and bag lengths of every table over its features, validating ids per feature
        # (all before any counter changes: a bad batch leaves the stats as they were)
        ids_of: Dict[str, List[torch.Tensor]] = {}
        lengths_of: Dict[str, List[torch.Tensor]] = {}
        for key, v, ln in zip(keys, per_key_values, per_key_lengths):
            lo, hi = (int(x) for x in torch.aminmax(v)) if v.numel() else (0, -1)
            for t in feature_tables[key]:
                n = self.num_embeddings[t]
                if lo < 0 or hi >= n:
                    bad = (v < 0) | (v >= n)
                    bad_id = int(v[int(bad.nonzero()[0, 0])])
                    raise ValueError(f"batch {index}: table {t!r} feature {key!r}: id {bad_id} is outside "
                                     f"[0, {n})")
                ids_of.setdefault(t, []).append(v)
                lengths_of.setdefault(t, []).append(ln)
        for t, parts in ids_of.items():
            ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            if ids.numel() == 0:
                continue
            one = torch.ones((), dtype=torch.int64).expand(ids.numel())
            self.counts[t].index_add_(0, ids, one)
            # presence: +1 once per distinct row. Every occurrence of a row writes the same value (its
            # presence before this batch, plus one), so duplicates within the batch add one in all.
            presence = self.presence[t]
            presence.scatter_(0, ids, presence.index_select(0, ids).add_(1))
            per_sample = lengths_of[t][0] if len(lengths_of[t]) == 1 else torch.stack(lengths_of[t]).sum(0)
            if int(per_sample.max()) <= 1:
                # at most one id of this table per sample: every (sample, row) pair is distinct
                self.sample_counts[t].index_add_(0, ids, one)
            else:
                n = self.num_embeddings[t]
                samples = torch.cat([torch.repeat_interleave(torch.arange(stride), ln) for ln in lengths_of[t]])
                pairs = torch.unique(samples * n + ids)  # distinct (sample, row)
                self.sample_counts[t].index_add_(0, pairs % n, torch.ones_like(pairs))
        self.num_batches += 1
        self.num_samples += stride
        return unserved

    # ------------------------------------------------------------------ derived rates

    def _check_table(self, table: str) -> None:
        if table not in self.num_embeddings:
            raise KeyError(f"table {table!r} is not in the access stats (tables: {self.tables})")

    def lookups_per_step(self, table: str, global_batch_size: int) -> torch.Tensor:
        """Expected lookups of each row per global step, ``counts / num_samples * G`` (float64 ``[n]``;
        zeros when nothing was sampled)."""
        self._check_table(table)
        return self._lookups_per_step(table, global_batch_size, None)

    def sample_probability(self, table: str) -> torch.Tensor:
        """Per-sample probability that a sample looks row ``x`` up at least once,
        ``sample_counts / num_samples`` (float64 ``[n]``; zeros when nothing was sampled)."""
        self._check_table(table)
        return self._sample_probability(table, None)

    def _lookups_per_step(self, table: str, global_batch_size: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`lookups_per_step` of the rows ``rows`` only (``None``: every row), value for value."""
        c = self.counts[table] if rows is None else self.counts[table][rows]
        if self.num_samples == 0:
            return torch.zeros(c.numel(), dtype=torch.float64)
        return c.to(torch.float64) * (float(global_batch_size) / self.num_samples)

    def _sample_probability(self, table: str, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`sample_probability` of the rows ``rows`` only (``None``: every row), value for value."""
        c = self.sample_counts[table] if rows is None else self.sample_counts[table][rows]
        if self.num_samples == 0:
            return torch.zeros(c.numel(), dtype=torch.float64)
        return c.to(torch.float64) / self.num_samples

    def _sampled_rows(self, table: str) -> torch.Tensor:
        """Ascending int64 ids of the rows with a nonzero ``counts`` or ``sample_counts`` (every other row
        has zero lookups per step and zero sample probability)."""
        return torch.nonzero(torch.logical_or(self.counts[table], self.sample_counts[table])).flatten()

    def total_lookups(self, table: str) -> int:
        """All sampled lookups of ``table``."""
        self._check_table(table)
        return int(self.counts[table].sum())

    def coverage_top_k(self, k: int) -> Dict[str, float]:
        """Per table, the share of its lookups that hit its ``min(k, rows)`` most looked-up rows
        (0.0 for a table never looked up)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return {t: self._coverage_one(t, int(k)) for t in self.tables}

    def coverage(self, top_fraction: float = 0.02) -> Dict[str, float]:
        """Per table, the share of its lookups that hit its ``ceil(top_fraction * rows)`` most
        looked-up rows (the P²RES skew statistic; same rule as ``data.measured_coverage``)."""
        if not 0.0 < top_fraction <= 1.0:
            raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
        return {t: self._coverage_one(t, math.ceil(top_fraction * self.num_embeddings[t])) for t in self.tables}

    def _coverage_one(self, table: str, k: int) -> float:
        """Share of ``table``'s lookups hitting its ``k`` most looked-up rows."""
        c = self.counts[table]
        total = int(c.sum())
        k = min(max(k, 0), c.numel())
        return int(c.topk(k).values.sum()) / total if total and k else 0.0

    def report(self, top_fraction: float = 0.02) -> str:
        """A header line, then one line per table: rows, lookups, rows seen, top-``top_fraction`` coverage."""
        cov = self.coverage(top_fraction)
        width = max([len(t) for t in self.tables] + [5])
        lines = [f"AccessStats: {len(self.tables)} tables, {self.num_batches} batches, "
                 f"{self.num_samples} samples"]
        for t in self.tables:
            seen = int((self.counts[t] > 0).sum())
            lines.append(f"  {t:<{width}}  rows {self.num_embeddings[t]:>10}  lookups {self.total_lookups(t):>11}"
                         f"  seen {seen:>10}  top {top_fraction * 100:g} % coverage {cov[t] * 100:6.2f} %")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checks

    def only(self, names: Iterable[str]) -> "AccessStats":
        """These counts for the tables ``names`` alone (copies)."""
        wanted = set(names)
        keep = [t for t in self.tables if t in wanted]

        def pick(d: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
            return None if d is None else {t: d[t] for t in keep if t in d}

        return dataclasses.replace(self, tables=keep, num_embeddings=pick(self.num_embeddings),
                                   feature_names=pick(self.feature_names), counts=pick(self.counts),
                                   sample_counts=pick(self.sample_counts), presence=pick(self.presence))

    def validate(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        """Raise ``ValueError`` unless these stats describe exactly ``tables`` (same table names, row
        counts and features)."""
        names, rows, features = _table_layout(tables)
        for t in names:
            if t not in self.num_embeddings:
                raise ValueError(f"table {t!r} of the model is not in the access stats "
                                 f"(stats tables: {self.tables})")
            if rows[t] != self.num_embeddings[t]:
                raise ValueError(f"table {t!r}: the access stats have {self.num_embeddings[t]} rows "
                                 f"but the model's table has {rows[t]}")
            if sorted(features[t]) != sorted(self.feature_names[t]):
                raise ValueError(f"table {t!r}: the access stats count features {self.feature_names[t]} "
                                 f"but the model's table serves {features[t]}")
        extra = [t for t in self.tables if t not in rows]
        if extra:
            raise ValueError(f"access stats tables {extra} are not in the model (model tables: {names})")

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> Dict[str, Any]:
        """Plain dict of ints, strings, lists and int64 tensors (what :meth:`save` writes)."""
        return {
            "format": _FORMAT, "version": _VERSION,
            "tables": list(self.tables),
            "num_embeddings": dict(self.num_embeddings),
            "feature_names": {t: list(f) for t, f in self.feature_names.items()},
            "num_batches": self.num_batches, "num_samples": self.num_samples,
            **{name: {t: getattr(self, name)[t].clone() for t in self.tables} for name in _COUNTERS},
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "AccessStats":
        """Inverse of :meth:`state_dict`."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"not an AccessStats file (format {state.get('format')!r})")
        if state.get("version") != _VERSION:
            raise ValueError(f"unsupported AccessStats version {state.get('version')!r}")
        return cls(tables=list(state["tables"]), num_embeddings=dict(state["num_embeddings"]),
                   feature_names={t: list(f) for t, f in state["feature_names"].items()},
                   counts=dict(state["counts"]), sample_counts=dict(state["sample_counts"]),
                   presence=dict(state["presence"]),
                   num_batches=state["num_batches"], num_samples=state["num_samples"])

    def to_json(self) -> str:
        """JSON text; the counters are stored sparsely (rows looked up at least once)."""
        state = self.state_dict()
        sparse: Dict[str, Any] = {}
        for t in self.tables:
            rows = self.counts[t].nonzero().flatten()
            rows = torch.unique(torch.cat([rows] + [getattr(self, n)[t].nonzero().flatten() for n in _COUNTERS]))
            sparse[t] = {"rows": rows.tolist(), **{n: getattr(self, n)[t][rows].tolist() for n in _COUNTERS}}
        for n in _COUNTERS:
            del state[n]
        state["rows"] = sparse
        return json.dumps(state)

    @classmethod
    def from_json(cls, text: str) -> "AccessStats":
        """Inverse of :meth:`to_json`."""
        state = json.loads(text)
        if "rows" not in state:
            raise ValueError("not an AccessStats JSON document (no 'rows')")
        for n in _COUNTERS:
            state[n] = {}
        for t, entry in state.pop("rows").items():
            rows = torch.tensor(entry["rows"], dtype=torch.int64)
            for n in _COUNTERS:
                dense = torch.zeros(int(state["num_embeddings"][t]), dtype=torch.int64)
                dense[rows] = torch.tensor(entry[n], dtype=torch.int64)
                state[n][t] = dense
        return cls.from_state_dict(state)

    def save(self, path: PathLike) -> None:
        """Write the stats: JSON when ``path`` ends in ``.json``, else ``torch.save`` of :meth:`state_dict`."""
        if os.fspath(path).endswith(".json"):
            with open(path, "w") as fh:
                fh.write(self.to_json())
        else:
            torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path: PathLike) -> "AccessStats":
        """Read stats written by :meth:`save` (JSON or torch format, by suffix)."""
        if os.fspath(path).endswith(".json"):
            with open(path) as fh:
                return cls.from_json(fh.read())
        return cls.from_state_dict(torch.load(path, weights_only=True))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AccessStats) and self.equal(other)

    __hash__ = None  # type: ignore[assignment]

    def equal(self, other: "AccessStats") -> bool:
        """Exact equality of every field and counter."""
        if (self.tables, self.num_embeddings, self.feature_names, self.num_batches, self.num_samples) != (
                other.tables, other.num_embeddings, other.feature_names, other.num_batches, other.num_samples):
            return False
        return all(torch.equal(getattr(self, n)[t], getattr(other, n)[t]) for n in _COUNTERS for t in self.tables)
