"""The ``data`` config group as typed dataclasses, one per source, whose defaults are the sources' own
constructor defaults (one place to change them): ``data=synthetic`` (default), ``data=criteo_tsv``,
``data=columnar``. Each validates itself when built (:meth:`build`: the source's constructor checks its
arguments and names them)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from torchrec_herald.data.base import DataSource, build_data_source
from torchrec_herald.data.columnar import ColumnarSource
from torchrec_herald.data.criteo_tsv import CriteoTSV
from torchrec_herald.data.synthetic import SyntheticCriteo

__all__ = ["ColumnarDataConfig", "CriteoTSVDataConfig", "DATA_CONFIGS", "SyntheticDataConfig"]


def _default(cls: type, name: str) -> Any:
    """``cls``'s constructor default for ``name``."""
    return inspect.signature(cls).parameters[name].default


class _Buildable:
    def build(self) -> DataSource:
        """The data source this config describes (its constructor validates the values)."""
        from omegaconf import OmegaConf

        return build_data_source(OmegaConf.structured(self))


@dataclass
class SyntheticDataConfig(_Buildable):
    """Synthetic Criteo-Kaggle-like data (:class:`~torchrec_herald.data.SyntheticCriteo`): 13 dense and 26
    sparse features, tables of Kaggle's cardinalities × ``scale``, Zipf-skewed ids, learnable labels."""

    name: str = "synthetic"
    seed: int = _default(SyntheticCriteo, "seed")
    scale: float = _default(SyntheticCriteo, "scale")
    zipf_alpha: float = _default(SyntheticCriteo, "zipf_alpha")
    num_train_batches: int = _default(SyntheticCriteo, "num_train_batches")  # global batches per train pass
    num_eval_batches: int = _default(SyntheticCriteo, "num_eval_batches")
    missing_rate: float = _default(SyntheticCriteo, "missing_rate")  # probability of an empty bag


@dataclass
class CriteoTSVDataConfig(_Buildable):
    """Criteo TSV files (Kaggle ``train.txt`` / Terabyte ``day_N``, optionally ``.gz``), streamed line by
    line (:class:`~torchrec_herald.data.CriteoTSV`); ids are ``int(hex, 16) % num_embeddings[f]``."""

    name: str = "criteo_tsv"
    paths: Any = MISSING  # training file or list of files, read in order as one stream
    eval_paths: Any = None  # eval file(s); null: every holdout_every-th global batch of paths is held out
    holdout_every: int = _default(CriteoTSV, "holdout_every")
    on_error: str = _default(CriteoTSV, "on_error")  # raise | skip (counted in stats()["skipped_lines"])
    num_embeddings: Optional[List[int]] = None  # 26 table sizes; null: Kaggle's cardinalities × scale
    scale: float = _default(CriteoTSV, "scale")


@dataclass
class ColumnarDataConfig(_Buildable):
    """Parquet or CSV files with declared columns (:class:`~torchrec_herald.data.ColumnarSource`)."""

    name: str = "columnar"
    paths: Any = MISSING  # training file or list of files (.parquet/.pq/.csv/.csv.gz)
    # {column: num_embeddings, ...} in feature (table) order. Typed Any, not Dict[str, int]: Hydra merges a
    # dict override into a typed dict node, and struct mode refuses its new keys (ColumnarSource checks it)
    sparse: Any = MISSING
    label: str = _default(ColumnarSource, "label")  # 0/1 label column
    dense: List[str] = field(default_factory=list)  # dense columns, in order (empty/null -> 0)
    eval_paths: Any = None
    holdout_every: int = _default(ColumnarSource, "holdout_every")
    on_error: str = _default(ColumnarSource, "on_error")
    hash_ids: bool = _default(ColumnarSource, "hash_ids")  # id % num_embeddings; false: out-of-range ids are errors
    log1p_dense: bool = _default(ColumnarSource, "log1p_dense")  # clamp dense at 0 and log1p (raw counts)
    format: Optional[str] = _default(ColumnarSource, "format")  # parquet | csv; null: from each file's suffix


#: ``data=<option>`` -> its config class
DATA_CONFIGS = {"synthetic": SyntheticDataConfig, "criteo_tsv": CriteoTSVDataConfig, "columnar": ColumnarDataConfig}
