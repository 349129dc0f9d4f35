"""Streaming reader of Criteo TSV files (Kaggle ``train.txt`` / Terabyte ``day_*``, optionally ``.gz``).

Each line has 40 tab-separated fields: the 0/1 label, 13 integer features and 26 hexadecimal
categorical ids. An empty field is a missing value: dense 0, categorical -> empty bag. Dense values
are clamped at 0 and ``log1p``-transformed; categorical ids are ``int(hex, 16) % num_embeddings[f]``
(so they are always in range and never negative). Files are read line by line.
"""

from __future__ import annotations

import logging
import re
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torchrec.datasets.utils import Batch

from torchrec_herald.data.base import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
    DataFormatError,
    kjt_from_ids,
    scaled_num_embeddings,
)
from torchrec_herald.data.files import FileSource, PathLike, open_text, shown

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_INT64_MAX = 2**63 - 1
#: What Python's ``int`` takes that the format has not: spaces and other whitespace around a value, ``_`` between
#: digits, ``+``, and ``0x`` before an id (a minus before an id is checked apart; non-ASCII digits fail ``isascii``).
_TOLERATED_BY_INT = (" ", "_", "+", "x", "X", "\x0b", "\x0c", "\r", "\x1c", "\x1d", "\x1e", "\x1f")


def _odd(line: str) -> bool:
    """Whether ``line`` holds a character ``int`` would read past (a substring test a character: the cheapest check
    in Python, a third of a regular expression's scan)."""
    if not line.isascii():
        return True
    for c in _TOLERATED_BY_INT:
        if c in line:
            return True
    return False


_DENSE = re.compile(r"-?[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]+")
#: A parsed line: (label, 13 raw integer dense values, 26 ids with -1 for missing).
TSVSample = Tuple[int, List[int], List[int]]


class CriteoTSV(FileSource[TSVSample]):
    """Criteo TSV source (see the module docstring for the format).

    Args:
        paths, eval_paths, holdout_every, on_error: see :class:`~torchrec_herald.data.files.FileSource`.
        num_embeddings: rows of the 26 tables; default: Criteo Kaggle cardinalities x ``scale``.
        scale: used only when ``num_embeddings`` is not given.
    """

    def __init__(
        self,
        paths: Union[PathLike, Sequence[PathLike]],
        eval_paths: Union[PathLike, Sequence[PathLike], None] = None,
        holdout_every: int = 10,
        on_error: str = "raise",
        num_embeddings: Optional[Sequence[int]] = None,
        scale: float = 0.01,
    ) -> None:
        super().__init__(paths, eval_paths, holdout_every, on_error)
        self.num_embeddings: List[int] = (
            scaled_num_embeddings(scale) if num_embeddings is None else [int(n) for n in num_embeddings]
        )
        if len(self.num_embeddings) != CAT_FEATURE_COUNT or min(self.num_embeddings) < 1:
            raise ValueError(
                f"num_embeddings must be {CAT_FEATURE_COUNT} positive ints, got {num_embeddings}"
            )
        self.feature_names: List[str] = list(DEFAULT_CAT_NAMES)
        self.num_dense: int = INT_FEATURE_COUNT

    def _parse(self, line: str) -> TSVSample:
        if _odd(line):
            raise ValueError
        fields = line.split("\t")
        if len(fields) != NUM_FIELDS or fields[0] not in ("0", "1"):
            raise ValueError
        dense = [int(x) if x else 0 for x in fields[1 : 1 + INT_FEATURE_COUNT]]
        if any(abs(d) > _INT64_MAX for d in dense):  # (a count past int64 overflows the dense tensor when collated)
            raise ValueError
        cats = fields[1 + INT_FEATURE_COUNT :]
        if "-" in line and any(x[:1] == "-" for x in cats):  # (a minus before an id: int(x, 16) would take it)
            raise ValueError
        ids = [int(x, 16) % n if x else -1 for x, n in zip(cats, self.num_embeddings)]
        return int(fields[0]), dense, ids

    @staticmethod
    def _diagnose(fields: List[str]) -> str:
        """Describe the first problem of a line that :meth:`_parse` rejected."""
        if len(fields) != NUM_FIELDS:
            return f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}"
        if fields[0] not in ("0", "1"):
            return f"field 1 (label): expected 0 or 1, got {shown(fields[0])}"
        for i, x in enumerate(fields[1:], start=2):
            dense = i <= 1 + INT_FEATURE_COUNT
            if x and (_DENSE if dense else _HEX).fullmatch(x) is None:
                if dense:
                    return f"field {i} ({DEFAULT_INT_NAMES[i - 2]}): expected an integer, got {shown(x)}"
                name = DEFAULT_CAT_NAMES[i - 2 - INT_FEATURE_COUNT]
                return f"field {i} ({name}): expected a hexadecimal id, got {shown(x)}"
            value = int(x) if x and dense else 0
            if dense and abs(value) > _INT64_MAX:
                return f"field {i} ({DEFAULT_INT_NAMES[i - 2]}): {shown(x)} is beyond an int64 count"
        return "malformed line"  # unreachable unless _parse and _diagnose disagree

    def _read(self, path: str) -> Iterator[Union[TSVSample, DataFormatError]]:
        logger.info("reading Criteo TSV %s", path)
        with open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                line = line.rstrip("\r\n")
                if not line:  # a blank line (a file's trailing one, say) holds no record, as in a CSV
                    continue
                try:
                    sample: Union[TSVSample, DataFormatError] = self._parse(line)
                except ValueError:
                    sample = DataFormatError(path, lineno, self._diagnose(line.split("\t")))
                yield sample

    def _collate(self, samples: Sequence[TSVSample]) -> Batch:
        labels, dense, ids = zip(*samples)
        ids_t = torch.tensor(ids, dtype=torch.int64).t()
        present = ids_t >= 0
        dense_t = torch.tensor(dense, dtype=torch.float64).clamp_(min=0).log1p_().float()
        return Batch(
            dense_features=dense_t,
            sparse_features=kjt_from_ids(self.feature_names, ids_t, None if bool(present.all()) else present),
            labels=torch.tensor(labels, dtype=torch.float32),
        )
