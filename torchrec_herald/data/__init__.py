"""Data layer of torchrec_herald: synthetic Criteo-like data, Criteo TSV and Parquet/CSV sources.

All sources implement :class:`DataSource` and yield ``torchrec.datasets.utils.Batch`` objects;
:func:`build_data_source` builds one from the ``data`` config group (``conf/data/*.yaml``).
"""

from torchrec_herald.data.base import (
    CRITEO_KAGGLE_CARDINALITIES,
    DataFormatError,
    DataSource,
    TrainStream,
    build_data_source,
    kjt_from_ids,
    kjt_from_lists,
    scaled_num_embeddings,
)
from torchrec_herald.data.columnar import ColumnarSource
from torchrec_herald.data.criteo_tsv import CriteoTSV
from torchrec_herald.data.files import FileSource
from torchrec_herald.data.synthetic import (
    CALIBRATION_MIN_ROWS,
    DEFAULT_ZIPF_ALPHA,
    SyntheticCriteo,
    calibrate_zipf_alpha,
    global_coverage,
    measured_coverage,
    table_coverage,
)

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "ColumnarSource",
    "CriteoTSV",
    "CALIBRATION_MIN_ROWS",
    "DEFAULT_ZIPF_ALPHA",
    "DataFormatError",
    "DataSource",
    "FileSource",
    "SyntheticCriteo",
    "TrainStream",
    "build_data_source",
    "calibrate_zipf_alpha",
    "global_coverage",
    "kjt_from_ids",
    "kjt_from_lists",
    "measured_coverage",
    "scaled_num_embeddings",
    "table_coverage",
]
