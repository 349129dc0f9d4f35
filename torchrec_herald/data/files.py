"""Shared machinery of the file-backed sources: streaming, error policy, train/eval split, rank sharding.

Split: with ``eval_paths`` the eval split is those files. Without, the train stream is cut into global
batches and every ``holdout_every``-th one (indices ``holdout_every - 1``, ``2 * holdout_every - 1``,
...) is held out for evaluation and excluded from training. The split is defined on global batches
of the *calling* geometry, so train and eval must be called with the same ``world_size *
batch_size`` for the held-out samples to be disjoint from the training ones.

Every rank parses (and validates) every record, so all ranks agree on which lines are skipped and
hence on the global batches, and a malformed line raises on every rank, not on one only.
"""

from __future__ import annotations

import abc
import gzip
import itertools
import logging
import os
import zlib
from typing import IO, Dict, Generic, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar, Union

from torchrec.datasets.utils import Batch

from torchrec_herald.data.base import PADDED_LABEL, DataFormatError, DataSource, check_start, global_batch_size

logger = logging.getLogger(__name__)

Sample = TypeVar("Sample")
PathLike = Union[str, "os.PathLike[str]"]
_MAX_SKIP_WARNINGS = 10
#: bytes at each end of a file that :meth:`FileSource.fingerprint` checks (with the file's size)
FINGERPRINT_BYTES = 1 << 20


def shown(value: str, limit: int = 60) -> str:
    """``repr(value)`` for an error line, cut at ``limit`` characters (a record glued to binary data, a huge field)."""
    if len(repr(value)) <= limit:
        return repr(value)
    cut = value[:limit]
    while len(repr(cut)) > limit:  # (whole characters: an escape is not cut in two)
        cut = cut[:-1]
    return f"{cut!r}... ({len(value)} characters)"


_GZIP_MAGIC = b"\x1f\x8b"


def _is_gzip(path: PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


#: compressed formats the readers do not open, by their first bytes (gzip they do, whatever the file's name)
_OTHER_COMPRESSION = {b"BZh": ("bzip2", "bunzip2"), b"\xfd7zXZ\x00": ("xz", "unxz"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
                      b"PK\x03\x04": ("zip", "unzip")}


def _what_is_not_read(path: PathLike) -> Optional[str]:
    """Why a file's first bytes are not records the readers can parse (another compression than gzip; a tar archive,
    gzip'd or not), or None: one read of its head (and of its gzip'd content's, for gzip)."""
    with open(path, "rb") as f:
        head = f.read(512)
    other = next((what for magic, what in _OTHER_COMPRESSION.items() if head.startswith(magic)), None)
    if other is not None:
        return f"the file is {other[0]}-compressed, which is not read here: decompress it ({other[1]}), or give it gzip'd"
    if head.startswith(_GZIP_MAGIC):
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(512)
        except (OSError, EOFError, zlib.error):
            return None  # (unreadable: the records' own reading says why)
    if head[257:262] == b"ustar":  # (Criteo Kaggle ships dac.tar.gz: its first record would be glued to the tar header)
        return "the file is a tar archive: extract its files (tar -xzf) and give those (Criteo Kaggle's dac.tar.gz holds train.txt)"
    return None


def open_text(path: PathLike, newline: Optional[str] = None, encoding: str = "utf-8") -> IO[str]:
    """Open a text file for streaming, transparently decompressing gzip (``*.gz``, or gzip's first bytes under
    another name)."""
    if str(path).endswith(".gz") or _is_gzip(path):
        return gzip.open(path, "rt", encoding=encoding, newline=newline)
    return open(path, "r", encoding=encoding, newline=newline)


def as_paths(paths: Union[PathLike, Sequence[PathLike], None]) -> List[str]:
    """Normalise a path or a list of paths to a list of strings."""
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def _check_each_file_once(paths: Sequence[str], eval_paths: Sequence[str]) -> None:
    """Each list names a file once (a training file listed twice trains its rows twice a pass): ValueError naming the
    file and the key. A file among both lists is the trainer's to refuse (:func:`files_in_both`): the Python API
    may evaluate on training files on purpose."""
    for key, group in (("data.paths", paths), ("data.eval_paths", eval_paths)):
        seen: Set[str] = set()
        for p in group:
            real = os.path.realpath(p)
            if real in seen:
                raise ValueError(f"{key} lists {p} more than once: each file is read once a pass; give it once")
            seen.add(real)


def files_in_both(paths: Sequence[str], eval_paths: Sequence[str]) -> List[str]:
    """The files of ``eval_paths`` that are training files too (by their real path)."""
    train = {os.path.realpath(p) for p in paths}
    return [p for p in eval_paths if os.path.realpath(p) in train]


class FileSource(DataSource, Generic[Sample]):
    """Base class of streaming file sources; subclasses implement :meth:`_read` and :meth:`_collate`.

    Args:
        paths: training file(s), read in order as one stream.
        eval_paths: evaluation file(s); if empty, every ``holdout_every``-th global batch of the
            training stream is held out instead.
        holdout_every: see above (>= 2).
        on_error: ``"raise"`` a :class:`DataFormatError` on a malformed record, or ``"skip"`` it
            (counted in ``stats()["skipped_lines"]``).

    ``stats()`` reports ``skipped_lines`` (distinct malformed records skipped so far),
    ``train_dropped_tail_samples`` / ``eval_dropped_tail_samples`` (incomplete trailing global
    batch of the last pass over each split) and their sum ``dropped_tail_samples``.
    """

    def __init__(
        self,
        paths: Union[PathLike, Sequence[PathLike]],
        eval_paths: Union[PathLike, Sequence[PathLike], None] = None,
        holdout_every: int = 10,
        on_error: str = "raise",
    ) -> None:
        self.paths, self.eval_paths = as_paths(paths), as_paths(eval_paths)
        if not self.paths:
            raise ValueError("paths: at least one training file is required")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if not self.eval_paths and int(holdout_every) < 2:
            raise ValueError(f"holdout_every must be >= 2 without eval_paths, got {holdout_every}")
        given = list(dict.fromkeys([*self.paths, *self.eval_paths]))
        folders = [p for p in given if os.path.isdir(p)]
        if folders:
            raise FileNotFoundError(f"data path(s) {', '.join(map(str, folders))} are directories: give their files, as "
                                    f"a list ([a.tsv,b.tsv])")
        missing = [p for p in given if not os.path.isfile(p)]
        if missing:  # fail before the model is built and sharded, on every rank alike
            wild = any(c in str(p) for p in missing for c in "*?[")
            raise FileNotFoundError(f"data file(s) not found: {', '.join(map(str, missing))}" + (
                " (a pattern is not expanded: give the files as a list, [a.tsv,b.tsv])" if wild else ""))
        _check_each_file_once(self.paths, self.eval_paths)
        self.holdout_every, self.on_error = int(holdout_every), on_error
        self._skipped: Set[Tuple[str, Union[int, str]]] = set()
        self._dropped: Dict[str, int] = {"train": 0, "eval": 0}
        #: global batch size -> the training batches a complete pass found (a count needs no second pass)
        self._passed: Dict[int, int] = {}
        # samples of the training stream a count has parsed from its start, and its length where a count reached its end
        self._counted_samples = 0
        self._stream_samples: Optional[int] = None

    @abc.abstractmethod
    def _read(self, path: str) -> Iterator[Union[Sample, DataFormatError]]:
        """Stream the records of one file: a parsed sample, or the error describing a bad record."""

    @abc.abstractmethod
    def _collate(self, samples: Sequence[Sample]) -> Batch:
        """Turn one rank's samples into a Batch."""

    def _records(self, path: str) -> Iterator[Union[Sample, DataFormatError]]:
        """:meth:`_read`, with a file that cannot be read on (a truncated ``.gz``, bytes that are not UTF-8, a
        file that is not Parquet) raised as one DataFormatError naming it and the last record read. The rest of
        such a file is unreadable, so ``on_error="skip"`` cannot skip past it."""
        n = 0
        try:
            for item in self._read(path):
                n += 1
                yield item
        except DataFormatError:
            raise
        except (OSError, EOFError, ValueError, zlib.error) as e:  # (UnicodeDecodeError, ArrowInvalid: ValueErrors)
            raise DataFormatError(path, f"after record {n}", f"the file cannot be read on: {type(e).__name__}: {e}") from e

    def _samples(self, paths: Sequence[str]) -> Iterator[Sample]:
        for path in paths:
            for item in self._records(path):
                if not isinstance(item, DataFormatError):
                    yield item
                    continue
                if self.on_error == "raise":
                    raise item
                key = (item.path, item.where)
                if key not in self._skipped:
                    self._skipped.add(key)
                    if len(self._skipped) <= _MAX_SKIP_WARNINGS:
                        logger.warning("skipping malformed record: %s", item)
                    if len(self._skipped) == _MAX_SKIP_WARNINGS:
                        logger.warning("further malformed records are skipped silently (see stats())")

    def _batches(self, split: str, rank: int, world_size: int, batch_size: int, start: int = 0,
                 pad_tail: bool = False) -> Iterator[Batch]:
        size = global_batch_size(rank, world_size, batch_size)
        holdout = not self.eval_paths
        paths = self.eval_paths if split == "eval" and not holdout else self.paths
        k = self.holdout_every

        def wanted(index: int) -> bool:
            return not holdout or (index % k == k - 1) == (split == "eval")

        block: List[Sample] = []
        index, returned = 0, 0
        for sample in self._samples(paths):
            block.append(sample)
            if len(block) == size:
                if wanted(index):
                    if returned >= start:  # the first ``start`` are read (the files are a stream), not collated
                        yield self._collate(block[rank * batch_size : (rank + 1) * batch_size])
                    returned += 1
                block, index = [], index + 1
        self._dropped[split] = len(block) if block and wanted(index) else 0
        if pad_tail and self._dropped[split]:  # (an eval pass: every sample scored once, see eval_batches)
            real, self._dropped[split] = len(block), 0
            block += [block[i % real] for i in range(size - real)]
            batch = self._collate(block[rank * batch_size : (rank + 1) * batch_size])
            batch.labels[max(0, real - rank * batch_size):] = PADDED_LABEL
            logger.info("%s: the last global batch's %d samples padded to %d (the padding's labels %g: left out of "
                        "the metrics)", split, real, size, PADDED_LABEL)
            yield batch
        if split == "train":
            self._passed[size] = returned
        if self._dropped[split]:
            logger.info(
                "%s: dropped incomplete trailing global batch of %d samples (global batch size %d)",
                split, self._dropped[split], size,
            )  # fmt: skip

    def check(self) -> None:
        """Every file is non-empty and its first record parses (with ``on_error="raise"``; with ``skip`` a
        file needs one good record among its first 1000): DataFormatError / ValueError naming the file. A file that
        holds no record (a header-only CSV or a zero-row Parquet part, as Spark writes for an empty partition) is
        passed over, in one warning, where another file of its split has records."""
        for key, paths in (("data.paths", self.paths), ("data.eval_paths", self.eval_paths)):
            recordless = [path for path in paths if not self._check_file(path)]
            if recordless and len(recordless) == len(paths):
                raise DataFormatError(recordless[0], 1, "the file holds no records" if len(paths) == 1 else
                                      f"the file holds no records, nor do the other {len(paths) - 1} file(s) of {key}")
            if recordless:
                logger.warning("%s: %d file(s) hold no records and are passed over: %s", key, len(recordless),
                               ", ".join(recordless[:5]) + (", ..." if len(recordless) > 5 else ""))

    def _check_file(self, path: str) -> bool:
        """:meth:`check` of one file: whether it holds a record (raising what is wrong with it)."""
        if os.path.getsize(path) == 0:
            raise DataFormatError(path, 1, "the file is empty")
        not_read = _what_is_not_read(path)
        if not_read is not None:
            raise DataFormatError(path, 1, not_read)
        for n, item in enumerate(self._records(path)):
            if not isinstance(item, DataFormatError):
                return True
            if self.on_error == "raise" or n >= 999:
                raise item
        return False

    def holds_eval_samples(self, world_size: int, batch_size: int) -> bool:
        """Whether the eval split holds a sample for global batches of ``world_size × batch_size`` (eval files: each
        holds a record, :meth:`check`; held out: the training stream reaches its first held-out batch, whose
        samples an evaluation scores even where the batch is incomplete, ``eval_batches(pad_tail=True)``)."""
        if self.eval_paths:
            return True
        needed = (self.holdout_every - 1) * int(world_size) * int(batch_size) + 1
        if self._counted_samples >= needed or self._stream_samples is not None:  # (a count parsed that far, or all)
            return self._counted_samples >= needed
        return sum(1 for _ in itertools.islice(self._samples(self.paths), needed)) == needed

    def count_train_batches(self, world_size: int, batch_size: int, at_least: Optional[int] = None) -> Optional[int]:
        """Count the training stream's global batches by parsing its records (held-out batches and, with
        ``on_error="skip"``, malformed records excluded), stopping once ``at_least`` are found: a check
        of the first records only. A malformed record met on the way raises naming its file and line. Once a pass of
        the training stream has ended, its count (nothing parsed again)."""
        size = int(world_size) * int(batch_size)
        if size in self._passed:  # (a pass of the training stream has counted them: a resume at its end, say)
            return self._passed[size]
        holdout, k = not self.eval_paths, self.holdout_every
        in_block = index = trained = parsed = 0
        ended = True
        for _ in self._samples(self.paths):
            in_block += 1
            parsed += 1
            if in_block == size:
                trained += int(not holdout or index % k != k - 1)
                in_block, index = 0, index + 1
                if at_least is not None and trained >= at_least:
                    ended = False
                    break
        self._counted_samples = max(self._counted_samples, parsed)
        if ended:
            self._stream_samples = parsed
        return trained

    def describe(self) -> str:
        files = [os.path.basename(p) for p in self.paths]
        shown = ", ".join(files[:3]) + (f", … ({len(files)} files)" if len(files) > 3 else "")
        return f"{type(self).__name__}({shown})"

    def fingerprint(self) -> List[Tuple[str, str, int, int]]:
        """Per file, training then eval: (its key, its path, its size, the CRC-32 of its first and last
        :data:`FINGERPRINT_BYTES`): two reads of each file, whatever its size."""
        out = []
        for key, paths in (("data.paths", self.paths), ("data.eval_paths", self.eval_paths)):
            for path in paths:
                size = os.path.getsize(path)
                with open(path, "rb") as f:
                    crc = zlib.crc32(f.read(FINGERPRINT_BYTES))
                    f.seek(max(size - FINGERPRINT_BYTES, 0))
                    crc = zlib.crc32(f.read(FINGERPRINT_BYTES), crc)
                out.append((key, str(path), size, crc))
        return out

    def train_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        """One pass over the training stream (held-out global batches excluded)."""
        return self._batches("train", rank, world_size, batch_size)

    def train_batches_from(self, rank: int, world_size: int, batch_size: int, start: int) -> Iterator[Batch]:
        """:meth:`train_batches` from global batch ``start`` (the records before it are parsed, not collated)."""
        return self._batches("train", rank, world_size, batch_size, check_start(start))

    def eval_batches(self, rank: int, world_size: int, batch_size: int, pad_tail: bool = False) -> Iterator[Batch]:
        """One pass over ``eval_paths``, or over the held-out global batches of the train stream. ``pad_tail``: an
        incomplete last global batch is yielded too, filled up with its own samples again whose labels are
        :data:`~torchrec_herald.data.base.PADDED_LABEL` (an evaluation leaves them out, and so scores every sample
        once); without, it is dropped and counted, as the training split's."""
        return self._batches("eval", rank, world_size, batch_size, pad_tail=pad_tail)

    def stats(self) -> Dict[str, int]:
        return {
            "skipped_lines": len(self._skipped),
            "dropped_tail_samples": self._dropped["train"] + self._dropped["eval"],
            "train_dropped_tail_samples": self._dropped["train"],
            "eval_dropped_tail_samples": self._dropped["eval"],
        }
