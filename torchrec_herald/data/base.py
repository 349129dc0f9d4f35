"""Common interface of the data layer: the ``DataSource`` ABC, Criteo constants and shared helpers.

Every source yields :class:`torchrec.datasets.utils.Batch` objects whose ``sparse_features`` is a
``KeyedJaggedTensor`` with one key per embedding table (keys in table order, values laid out
feature-major, TorchRec's layout).

Rank sharding convention (all sources): data is consumed in *global batches* of
``world_size * batch_size`` consecutive samples and rank ``r`` gets samples ``[r*B, (r+1)*B)`` of
each global batch. The same seed / files therefore give the same global batches whatever the
world size, as long as the global batch size is the same. An incomplete trailing global batch is
dropped (uneven per-rank batches break TorchRec's row-wise sharded backward) and counted in
``stats()["dropped_tail_samples"]``.
"""

from __future__ import annotations

import abc
import collections
import importlib
import inspect
import itertools
import logging
import math
import re
from typing import Any, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.datasets.criteo import (  # noqa: F401 (re-exported)
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logger = logging.getLogger(__name__)

#: Number of distinct values of the 26 categorical features of the Criteo Kaggle (Display
#: Advertising Challenge) data set, in feature order cat_0 .. cat_25.
CRITEO_KAGGLE_CARDINALITIES: Tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

#: Lower bound on the rows of a scaled-down table (see :func:`scaled_num_embeddings`).
MIN_TABLE_ROWS = 16


def scaled_num_embeddings(
    scale: float, cardinalities: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES
) -> List[int]:
    """Rows of each table when the Criteo cardinalities are scaled by ``scale``.

    Each table gets ``max(ceil(card * scale), min(card, 16))`` rows: large tables shrink
    proportionally, while small tables keep at least 16 rows (or all their values when the
    feature has fewer than 16, e.g. cat_8 with 3), so that tiny features are not collapsed into
    one or two rows. ``scale=1`` gives the full Kaggle cardinalities.
    """
    if not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    # the 1e-9 keeps float noise (e.g. 0.07 * 100 = 7.000000000000001) from adding a row
    return [max(math.ceil(c * scale - 1e-9), min(c, MIN_TABLE_ROWS)) for c in cardinalities]


#: the label of a sample that only fills up an evaluation's last global batch (``eval_batches(pad_tail=True)``): every
#: rank runs the same batches through the sharded model, and the metrics leave these out
PADDED_LABEL = -1.0


class DataFormatError(ValueError):
    """A malformed input record; the message reads ``<path>:<line or row>: <what is wrong>``."""

    def __init__(self, path: Any, where: Union[int, str], problem: str) -> None:
        self.path, self.where, self.problem = str(path), where, problem
        super().__init__(f"{self.path}:{where}: {problem}")

    def __reduce__(self) -> Tuple[type, Tuple[str, Union[int, str], str]]:  # picklable across processes
        return type(self), (self.path, self.where, self.problem)


class DataSource(abc.ABC):
    """A source of training / evaluation :class:`Batch` es for one DLRM model.

    Attributes:
        feature_names: sparse feature keys, in table order (one embedding table per feature).
        num_embeddings: rows of each feature's table; every id a source yields is in
            ``[0, num_embeddings[f])``.
        num_dense: number of dense features (width of ``Batch.dense_features``).
    """

    feature_names: List[str]
    num_embeddings: List[int]
    num_dense: int

    @abc.abstractmethod
    def train_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """One pass over the training split: this rank's ``batch_size`` slice of each global batch."""

    @abc.abstractmethod
    def eval_batches(self, rank: int, world_size: int, batch_size: int, pad_tail: bool = False) -> Iterator[Batch]:
        """One pass over the evaluation split, sharded like :meth:`train_batches`. ``pad_tail``: a source whose
        split can end in an incomplete global batch yields it too, filled up to size with samples labelled
        :data:`PADDED_LABEL`, which an evaluation leaves out."""

    def train_batches_from(self, rank: int, world_size: int, batch_size: int, start: int) -> Iterator[Batch]:
        """:meth:`train_batches` from global batch ``start`` on (a checkpoint's position, a stream that
        switches between whole batches and slices). This default reads and drops the first ``start``;
        seekable sources override it to skip them without reading."""
        return itertools.islice(self.train_batches(rank, world_size, batch_size), check_start(start), None)

    def stats(self) -> Dict[str, int]:
        """Counters for metrics.json (``skipped_lines``, ``dropped_tail_samples``, ...)."""
        return {"skipped_lines": 0, "dropped_tail_samples": 0}

    def check(self) -> None:
        """Cheap checks before anything is built or trained (file sources: every file has a first record
        that parses); raises naming the file and line."""
        return None

    def count_train_batches(self, world_size: int, batch_size: int, at_least: Optional[int] = None) -> Optional[int]:
        """How many global batches of ``world_size × batch_size`` samples one pass over the training split
        holds, or None when the source cannot tell without training. ``at_least``: the caller only needs
        to know whether there are that many; a source may stop counting there (files are then read up to
        that point only). This default knows ``num_train_batches`` when the source has it."""
        n = getattr(self, "num_train_batches", None)
        return None if n is None else int(n)

    def describe(self) -> str:
        """What the source reads, for messages (e.g. ``CriteoTSV(day_0.tsv)``)."""
        return type(self).__name__

    def fingerprint(self) -> List[Tuple[str, str, int, int]]:
        """What this rank reads, to compare with the other ranks' (:func:`check_same_data_on_every_rank`): per file
        (its key, its path, its size, a checksum of its first and last bytes). A source made from the config alone
        (synthetic data) is the same on every rank: none."""
        return []


def check_same_data_on_every_rank(files: List[Tuple[str, str, int, int]]) -> None:
    """Every rank reads the same data (collective; nothing at one rank). Each rank makes every global batch from the
    same files, so a copy that differs on one host (partly copied, another version) trained other samples there,
    held other batches out for eval, or ended early and left the others waiting in a collective. ValueError on every
    rank naming the first file that differs, how, and the ranks and hosts that read another copy. ``files``: this
    rank's :meth:`DataSource.fingerprint`, taken among its checks (a file it cannot read is its own error)."""
    import torch.distributed as dist

    from torchrec_herald.dist_utils import with_hosts

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    views = with_hosts(files)
    ours, host0 = views[0]
    for n, (key, path, size, checksum) in enumerate(ours):
        other = [(r, host, theirs[n] if n < len(theirs) else None) for r, (theirs, host) in enumerate(views)
                 if n >= len(theirs) or theirs[n][2:] != (size, checksum)]
        if not other:
            continue
        ranks = ", ".join(f"{r} (host {host})" for r, host, _ in other[:4]) + (" …" if len(other) > 4 else "")
        sizes = {f[2] for _, _, f in other if f is not None}
        how = (f"{size} bytes on rank 0 (host {host0}), {', '.join(map(str, sorted(sizes)))} on rank(s) {ranks}"
               if sizes - {size} else f"the same {size} bytes on rank 0 (host {host0}) and rank(s) {ranks}, but other "
                                       f"bytes at its start or end")
        if path.endswith(".gz") and not sizes - {size}:  # (gzip's header holds the time it was compressed)
            how += " (gzip'd on each host apart? copy the .gz files themselves)"
        raise ValueError(f"{key} file {path} differs between ranks: {how}. Every rank makes each global batch from "
                         f"the same files: copy them whole to every host, or read them from a file system every host "
                         f"shares")


class TrainStream(Iterator[Batch]):
    """One pass over a source's train batches from global batch ``start``, each one either whole
    (``whole=True``: the ``world_size * batch_size`` samples every rank of a herald pipeline with
    ``global_batches`` reads) or as this rank's slice. ``whole`` may change between batches: a pipeline
    whose scheduling is off reads only its own samples from then on, with no batch skipped or read twice.

    ``keep``: the last batches returned are kept (at most this many), so that :meth:`rewind` to one of them, as a
    herald pipeline's window needs at a checkpoint, returns them again without reading the source from the pass's
    start (a file is a stream: a re-read parses every record before the position).

    Attributes:
        whole: read the next batch whole (True) or as this rank's slice.
        position: the global batch the next read returns (``start`` + batches returned so far).
    """

    def __init__(self, source: "DataSource", rank: int, world_size: int, batch_size: int, start: int = 0,
                 whole: bool = False, keep: int = 0) -> None:
        global_batch_size(rank, world_size, batch_size)
        self.source, self.rank, self.world_size, self.batch_size = source, rank, world_size, batch_size
        self.whole, self.position = whole, start
        self._it: Optional[Iterator[Batch]] = None
        self._it_whole: Optional[bool] = None
        #: (global batch, whole, batch) of the last ``keep`` returned; the ones to return again after a rewind
        self._kept: Deque[Tuple[int, bool, Batch]] = collections.deque(maxlen=max(0, int(keep)))
        self._again: Deque[Tuple[int, bool, Batch]] = collections.deque()

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> Batch:
        if self._again and self._again[0][1] != self.whole:  # (kept in the other form: read from the source)
            self._again.clear()
            self._it = None
        if self._again:
            _, whole, batch = self._again.popleft()
        else:
            if self._it is None or self._it_whole != self.whole:  # (re)open at the position, in the wanted form
                shape = (0, 1, self.world_size * self.batch_size) if self.whole else (
                    self.rank, self.world_size, self.batch_size)
                self._it, self._it_whole = self.source.train_batches_from(*shape, self.position), self.whole
            batch, whole = next(self._it), self.whole
        if self._kept.maxlen:
            self._kept.append((self.position, whole, batch))
        self.position += 1
        return batch

    def rewind(self, position: int) -> "TrainStream":
        """Go back to global batch ``position`` (at most :attr:`position`): the batches returned since come again,
        from those kept where all of them are, else read from the source. Returns the stream."""
        if not 0 <= position <= self.position:
            raise ValueError(f"rewind to global batch {position}: the stream is at {self.position}")
        back = self.position - position
        if back and len(self._kept) >= back:
            for _ in range(back):
                self._again.appendleft(self._kept.pop())
        elif back:
            self._again.clear()
            self._kept.clear()
            self._it = None
        self.position = position
        return self


def check_start(start: int) -> int:
    """Validate the global batch a :meth:`DataSource.train_batches_from` starts at, and return it."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    return start


def global_batch_size(rank: int, world_size: int, batch_size: int) -> int:
    """Validate a rank/world/batch triple and return the global batch size."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return world_size * batch_size


def kjt_from_ids(
    keys: Sequence[str], ids: torch.Tensor, present: Optional[torch.Tensor] = None
) -> KeyedJaggedTensor:
    """KJT of one-hot features from an ``[F, B]`` id tensor (``present[f, b]`` False -> empty bag)."""
    if present is None:
        lengths = torch.ones(ids.numel(), dtype=torch.int32)
        values = ids.reshape(-1)
    else:
        lengths = present.reshape(-1).to(torch.int32)
        values = ids[present]  # boolean indexing is row-major, i.e. feature-major here
    return KeyedJaggedTensor.from_lengths_sync(list(keys), values.to(torch.int64), lengths)


def kjt_from_lists(keys: Sequence[str], samples: Sequence[Sequence[Sequence[int]]]) -> KeyedJaggedTensor:
    """KJT of multi-hot features; ``samples[b][f]`` is the (possibly empty) id list of sample b."""
    num_features = len(keys)
    lengths = [len(s[f]) for f in range(num_features) for s in samples]
    values = [v for f in range(num_features) for s in samples for v in s[f]]
    return KeyedJaggedTensor.from_lengths_sync(
        list(keys), torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32)
    )


_SOURCES: Dict[str, str] = {
    "synthetic": "torchrec_herald.data.synthetic:SyntheticCriteo",
    "criteo_tsv": "torchrec_herald.data.criteo_tsv:CriteoTSV",
    "columnar": "torchrec_herald.data.columnar:ColumnarSource",
}


def build_data_source(cfg: Union[Mapping[str, Any], Any]) -> DataSource:
    """Build a source from a config (OmegaConf node or plain mapping) dispatching on ``cfg.name``.

    All other keys are the source class's constructor arguments; unknown or missing keys raise
    ``ValueError`` naming them.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    if OmegaConf.is_config(cfg):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as e:
            raise ValueError(f"data config: mandatory value missing (???): {e}") from e
    kwargs = dict(cfg)
    name = kwargs.pop("name", None)
    if name not in _SOURCES:
        raise ValueError(f"unknown data source name {name!r}; known: {sorted(_SOURCES)}")
    module, attr = _SOURCES[name].split(":")
    cls = getattr(importlib.import_module(module), attr)
    params = inspect.signature(cls).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(
            f"data source {name!r}: unknown config key(s) {unknown}; allowed: {['name', *params]}"
        )
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in kwargs]
    if missing:
        raise ValueError(f"data source {name!r}: missing config key(s) {missing}")
    logger.info("building data source %s(%s)", attr, kwargs)
    try:
        return cls(**kwargs)
    except ValueError as e:
        # a value the source refuses: name it by its config key (``data.scale``), as every other group does
        key = re.match(r"\w+", str(e))
        if type(e) is not ValueError or key is None or key.group(0) not in params:
            raise
        raise ValueError(f"data.{e}") from None
