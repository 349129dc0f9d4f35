"""Columnar source: Parquet (pyarrow, streamed by record batches) or CSV (streamed, header row required).

Columns are declared in the config: ``label: <col>`` (values 0/1), ``dense: [cols]`` (numbers,
empty/null = 0) and ``sparse: {col: num_embeddings, ...}`` (feature names = column names, in the
declared order). A sparse cell is an integer id, empty/null = missing (empty bag), a ``|``-separated
list of ids in CSV (multi-hot, e.g. ``3|17``) or a ``list<int>`` in Parquet. With ``hash_ids`` ids
are taken modulo the table size; without, an id outside ``[0, num_embeddings)`` is a
:class:`~torchrec_herald.data.base.DataFormatError`. Errors name ``<file>:<line>`` for CSV (physical
line, header = line 1) and ``<file>:row <n>`` (1-based data row) for Parquet.
"""

from __future__ import annotations

import csv
import logging
import math
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import pyarrow.parquet as pq
import torch
from torchrec.datasets.utils import Batch

from torchrec_herald.data.base import DataFormatError, kjt_from_lists
from torchrec_herald.data.files import FileSource, PathLike, open_text, shown

logger = logging.getLogger(__name__)

#: A parsed row: (label, dense values, one id list per sparse feature).
ColumnarSample = Tuple[float, List[float], List[List[int]]]
_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".csv.gz": "csv"}
_PARQUET_BATCH_ROWS = 65536
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _label(v: Any) -> float:
    try:
        x = float(v) if v is not None and v != "" else None
    except (TypeError, ValueError):
        x = None
    if x not in (0.0, 1.0):
        raise ValueError(f"label must be 0 or 1, got {v!r}")
    return x  # type: ignore[return-value]


def _number(v: Any) -> float:
    if v is None or v == "":
        return 0.0
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {v!r}")
    return x


def _int(v: Any) -> int:
    if isinstance(v, bool):  # (a bool column is no id column, though Python's bool is an int)
        raise ValueError
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():  # e.g. pandas' float columns with NaN
        return int(v)
    if isinstance(v, str):
        if not v.isascii() or "_" in v or v != v.strip():  # (int() reads past these: '1_3' would be id 13)
            raise ValueError
        try:
            return int(v)
        except ValueError:
            x = float(v)  # '3.0': how pandas writes an int column with missing values to CSV
            if x.is_integer():
                return int(x)
            raise
    raise ValueError


class ColumnarSource(FileSource[ColumnarSample]):
    """Parquet / CSV source with configurable columns (see the module docstring).

    Args:
        paths, eval_paths, holdout_every, on_error: see :class:`~torchrec_herald.data.files.FileSource`.
        sparse: ``{column: num_embeddings}`` in feature order.
        label: the label column.
        dense: the dense columns, in order.
        hash_ids: ``id % num_embeddings`` (default) instead of rejecting out-of-range ids.
        log1p_dense: clamp dense values at 0 and apply ``log1p`` (for raw counts, like Criteo).
        format: ``"parquet"`` or ``"csv"``; default: inferred from each file's suffix.
    """

    def __init__(
        self,
        paths: Union[PathLike, Sequence[PathLike]],
        sparse: Mapping[str, int],
        label: str = "label",
        dense: Sequence[str] = (),
        eval_paths: Union[PathLike, Sequence[PathLike], None] = None,
        holdout_every: int = 10,
        on_error: str = "raise",
        hash_ids: bool = True,
        log1p_dense: bool = False,
        format: Optional[str] = None,
    ) -> None:
        if not isinstance(sparse, Mapping) or not sparse:
            raise ValueError("sparse must map at least one sparse column to its table size, "
                             f"{{name: num_embeddings, ...}}, got {sparse!r}")
        bad = {c: n for c, n in sparse.items() if isinstance(n, bool) or not isinstance(n, int)}
        if bad:
            raise ValueError(f"sparse: each table size must be an integer, got {bad}")
        small = {c: n for c, n in sparse.items() if n < 1}
        if small:
            raise ValueError(f"sparse: each table size must be >= 1, got {small}")
        super().__init__(paths, eval_paths, holdout_every, on_error)
        self.label, self.dense = str(label), [str(c) for c in dense]
        self.feature_names: List[str] = [str(c) for c in sparse]
        self.num_embeddings: List[int] = [int(n) for n in sparse.values()]
        self.num_dense: int = len(self.dense)
        self._columns = [self.label, *self.dense, *self.feature_names]
        if len(set(self._columns)) != len(self._columns):
            raise ValueError(f"label, dense and sparse columns must be distinct, got {self._columns}")
        if format not in (None, "parquet", "csv"):
            raise ValueError(f"format must be 'parquet', 'csv' or null, got {format!r}")
        self.hash_ids, self.log1p_dense, self.format = bool(hash_ids), bool(log1p_dense), format
        for path in self.paths + self.eval_paths:
            self._format_of(path)  # fail early on unknown suffixes

    def _format_of(self, path: str) -> str:
        if self.format:
            return self.format
        for suffix, fmt in _FORMATS.items():
            if path.lower().endswith(suffix):
                return fmt
        raise ValueError(f"{path}: cannot infer the format from its suffix (known: {sorted(_FORMATS)}); set "
                         f"data.format=csv or data.format=parquet")

    def _ids(self, v: Any, n: int) -> List[int]:
        if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
            return []
        items = v.split("|") if isinstance(v, str) else v if isinstance(v, (list, tuple)) else [v]
        try:
            ids = [_int(x) for x in items]
        except ValueError:
            raise ValueError(f"expected integer id(s), got {v!r}") from None
        if self.hash_ids:
            return [i % n for i in ids]
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"id {i} out of range for a table of {n} rows (hash_ids is false)")
        return ids

    def _sample(
        self, path: str, where: Union[int, str], cells: Sequence[Any]
    ) -> Union[ColumnarSample, DataFormatError]:
        column = self.label
        try:
            label = _label(cells[0])
            dense: List[float] = []
            for column, v in zip(self.dense, cells[1:]):
                dense.append(_number(v))
                if not self.log1p_dense and abs(dense[-1]) > _FLOAT32_MAX:  # (it would train as inf: a nan loss)
                    raise ValueError(f"{v!r} overflows float32, the dense features' type (largest {_FLOAT32_MAX:.4g})")
            sparse: List[List[int]] = []
            for column, v, n in zip(self.feature_names, cells[1 + self.num_dense :], self.num_embeddings):
                sparse.append(self._ids(v, n))
        except ValueError as e:
            return DataFormatError(path, where, f"column {column!r}: {e}")
        return label, dense, sparse

    def _missing_columns(self, path: str, where: Union[int, str], names: Sequence[str]) -> None:
        missing = [c for c in self._columns if c not in names]
        if missing:  # a file-level problem: raised whatever on_error says
            found = list(names)  # (each cut: a TSV given as a CSV has one column, its whole first line)
            raise DataFormatError(path, where, f"missing column(s) {missing}; found [{', '.join(shown(c, 40) for c in found[:20])}"
                                               + (f", ... ({len(found)} columns)]" if len(found) > 20 else "]"))
        twice = sorted({c for c in self._columns if list(names).count(c) > 1})
        if twice:  # which of the copies is meant is not for us to guess
            raise DataFormatError(path, where, f"column(s) {twice} appear more than once in the header")

    def _read(self, path: str) -> Iterator[Union[ColumnarSample, DataFormatError]]:
        logger.info("reading %s", path)
        if self._format_of(path) == "parquet":
            pfile = pq.ParquetFile(path)
            self._missing_columns(path, "schema", pfile.schema_arrow.names)
            row = 0
            for rb in pfile.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=self._columns):
                for cells in zip(*(rb.column(c).to_pylist() for c in self._columns)):
                    row += 1
                    yield self._sample(path, f"row {row}", cells)
            return
        with open_text(path, newline="", encoding="utf-8-sig") as f:  # (a spreadsheet's byte-order mark dropped)
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise DataFormatError(path, 1, "empty file; a header row is required")
            self._missing_columns(path, 1, header)
            index = [header.index(c) for c in self._columns]
            spanned = False
            while True:
                first = reader.line_num + 1  # the record's first line (a quoted field may run over several)
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as e:  # (one record: the reader goes on at the next line)
                    limit = "field larger than field limit" in str(e)
                    item = DataFormatError(path, reader.line_num, f"{e}" + (
                        f": a field of more than {csv.field_size_limit()} characters (a long multi-hot list); give "
                        f"such data as Parquet" if limit else ""))
                else:
                    if not row:  # blank line
                        continue
                    if len(row) != len(header):
                        item = DataFormatError(path, first, f"expected {len(header)} comma-separated fields, got "
                                                            f"{len(row)}")
                    else:
                        item = self._sample(path, first, [row[i] for i in index])
                if reader.line_num > first and not isinstance(item, DataFormatError) and not spanned:
                    spanned = True  # (CSV allows it; a stray quote in a column not read looks the same: say it once)
                    logger.warning("%s:%d: a quoted field runs from this line to line %d (one record of %d lines)",
                                   path, first, reader.line_num, reader.line_num - first + 1)
                if isinstance(item, DataFormatError) and reader.line_num > first and not item.problem.startswith("column"):
                    # a quote opened on one line and closed lines later (or never) took those lines into one bad
                    # record: a file-level problem, raised whatever on_error says (skipping it would drop them all)
                    raise DataFormatError(path, first, f"a quoted field opened on this line runs to line "
                                                       f"{reader.line_num}, taking {reader.line_num - first + 1} lines "
                                                       f"into one record ({item.problem}): an unmatched '\"'?")
                yield item

    def _collate(self, samples: Sequence[ColumnarSample]) -> Batch:
        labels, dense, sparse = zip(*samples)
        dense_t = torch.tensor(dense, dtype=torch.float64).reshape(len(samples), self.num_dense)
        if self.log1p_dense:
            dense_t = dense_t.clamp_(min=0).log1p_()
        return Batch(
            dense_features=dense_t.float(),
            sparse_features=kjt_from_lists(self.feature_names, sparse),
            labels=torch.tensor(labels, dtype=torch.float32),
        )
