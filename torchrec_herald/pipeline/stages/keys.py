"""Stage 1 of a batch entering the window: the batch on CPU in the EBC's feature order, its ids
validated, their global row keys (``layout.feature_offsets[f] + id``) and each key's sample: one compiled
pass (``native/batch_keys.cpp``) where the module is built, the torch ops below otherwise and to name a
bad id."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from torchrec_herald.native import load_if_built
from torchrec_herald.ops.hot_cold import first_invalid_id, out_of_table
from torchrec_herald.pipeline.context import CommTimer, HeraldBatchContext, SchedulingEnv, on_every_rank
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["CheckedOwnBatches", "OwnBatchDescriptions", "describe_own_batch", "key_batch", "keys_stage",
           "settle_own_batch"]

#: what a loader must yield, and why a weighted KJT is refused (the same words for own and whole batches)
_A_BATCH = "a torchrec Batch (dense_features, sparse_features, labels)"
#: the fixed-size description of a rank's own batch that every rank gathers before any exchange sized by it
_HEADER = ("present", "samples", "dense_columns", "label_values", "weighted", "features", "feature_names_crc",
           "content_crc")


def _header(raw: Optional[Batch], whole: bool = False) -> torch.Tensor:
    """This rank's batch described by :data:`_HEADER`'s fields (all 0: no batch; all -1: not a ``Batch``; -1
    for dense columns or label values: not one row a sample, samples first, as a move carries them). ``whole``:
    the batch is meant to be every rank's (``global_batches=True``), and a digest of its first labels and dense
    values is added (0 otherwise: :func:`_content_crc`)."""
    if raw is None:  # this rank's loader is dry
        return torch.zeros(len(_HEADER), dtype=torch.int64)
    if not isinstance(raw, Batch):
        return torch.full((len(_HEADER),), -1, dtype=torch.int64)
    kjt = raw.sparse_features
    B = kjt.stride()
    dense = raw.dense_features
    labels = raw.labels[0].numel() if raw.labels.dim() >= 1 and raw.labels.shape[0] == B > 0 else -1  # samples first
    return torch.tensor([1, B, dense.shape[1] if dense.dim() == 2 and dense.shape[0] == B else -1, labels,
                         int(kjt.weights_or_none() is not None), len(kjt.keys()),
                         zlib.crc32("\0".join(sorted(kjt.keys())).encode()), _content_crc(raw) if whole else 0],
                        dtype=torch.int64)


#: the elements of a batch's labels and dense features its digest reads (a loader of each rank's own batches differs
#: in them throughout; the whole of a 65,536-sample batch took 12 ms to hash)
DIGEST_ELEMENTS = 4096


def _content_crc(raw: Batch) -> int:
    """A digest of a batch's first labels and dense features, as bytes: what does not depend on the order of its
    KJT's keys, which may differ between ranks."""
    crc = 0
    for t in (raw.labels, raw.dense_features):
        head = t.detach().reshape(-1)[:DIGEST_ELEMENTS].to("cpu").contiguous()
        crc = zlib.crc32(head.view(torch.uint8).numpy().tobytes(), crc)
    return crc


@dataclass
class OwnBatchDescriptions:
    """Every rank's description of its batch ``index``, gathered (``work``: the gather in flight, or None)."""

    raw: Optional[Batch]
    index: int
    every: torch.Tensor
    work: Any = None
    whole: bool = False


def describe_own_batch(env: SchedulingEnv, raw: Optional[Batch], index: int, whole: bool = False
                       ) -> OwnBatchDescriptions:
    """(collective, fixed size, asynchronous) Start gathering every rank's description of its batch ``index``
    (``raw``; None: this rank's loader is dry; ``whole``: meant to be every rank's global batch).
    :func:`settle_own_batch` waits for it and checks it."""
    mine = _header(raw, whole and env.world > 1)
    if env.world == 1:
        return OwnBatchDescriptions(raw, index, mine.view(1, -1), whole=whole)
    every = torch.empty(env.world * mine.numel(), dtype=torch.int64)
    with CommTimer(env.stats, "herald_schedule_meta"):
        work = dist.all_gather_into_tensor(every, mine, group=env.scheduling_group, async_op=True)
    return OwnBatchDescriptions(raw, index, every.view(env.world, -1), work, whole)


class CheckedOwnBatches:
    """A loader of this rank's own batches (``source``), each checked with every rank's
    (:func:`settle_own_batch`) before it is handed over. The next batch is read, and its description's gather
    started, as one is handed over, so that the gather completes while a step trains (gathered when each is
    read instead, the check cost 0.7 ms a step of 15 with scheduling on and 1.5-2 ms with it off, at two
    ranks here: ``benchmarks/own_batch_check.py``). The batch read ahead stays here: whoever reads next
    (the run-ahead thread scheduling on, TorchRec's pipeline scheduling off) gets it. The loader is dry for
    good once every rank's is (StopIteration); a batch that raised is dropped, the next read goes on."""

    def __init__(self, env: SchedulingEnv, source: Iterator[Batch], whole: bool = False) -> None:
        self.env, self.source, self.whole = env, source, whole
        self._pending: Optional[OwnBatchDescriptions] = None
        self._index, self._dry = 0, False

    def __iter__(self) -> "CheckedOwnBatches":
        return self

    def __next__(self) -> Batch:
        if self._dry:
            raise StopIteration
        pending, self._pending = self._pending or self._read(), None
        if not settle_own_batch(self.env, pending) or pending.raw is None:
            self._dry = True
            raise StopIteration
        self._pending = self._read()
        return pending.raw

    def _read(self) -> OwnBatchDescriptions:
        try:
            raw: Optional[Batch] = next(self.source)
        except StopIteration:
            raw = None
        self._index += 1
        return describe_own_batch(self.env, raw, self._index - 1, self.whole)


def settle_own_batch(env: SchedulingEnv, described: OwnBatchDescriptions) -> bool:
    """Where each rank reads a batch of its own, every rank's batch is described to every rank before any
    exchange sized by it (:func:`describe_own_batch`), and a batch that cannot be trained with the others
    raises here on every rank alike, naming the ranks: a loader that runs dry before the others' (which
    would leave them waiting in a collective), a different number of samples, feature names or dense
    columns, per-sample weights (herald's sharding has none, and moving samples would drop them), labels
    that are not one value (or the same number of values) per sample. Returns whether the batch exists
    (False: every rank's loader is dry, the data's end)."""
    raw, index = described.raw, described.index
    if described.work is not None:
        with CommTimer(env.stats, "herald_schedule_meta"):
            described.work.wait()
    every = described.every
    col = {name: every[:, i].tolist() for i, name in enumerate(_HEADER)}
    not_batches = [r for r, p in enumerate(col["present"]) if p < 0]
    if not_batches:
        raise on_every_rank(TypeError(
            f"HeraldTrainPipeline, batch {index}: the data loader of rank(s) {not_batches} yielded "
            f"{type(raw).__name__ if not isinstance(raw, Batch) else 'something'} where {_A_BATCH} is expected"))
    dry = [r for r, p in enumerate(col["present"]) if not p]
    if len(dry) == env.world:
        return False
    where = f"HeraldTrainPipeline, batch {index}"
    if dry:
        more = [r for r in range(env.world) if r not in dry]
        raise on_every_rank(ValueError(
            f"{where}: the data loader of rank(s) {dry} ran out while rank(s) {more} still had batches; every "
            f"rank's loader must yield the same number of batches (drop the remainder)"))
    weighted = [r for r, w in enumerate(col["weighted"]) if w]
    if weighted:
        raise on_every_rank(ValueError(
            f"{where}: the KJT of rank(s) {weighted} carries per-sample weights; {env.ebc.no_weights()}"))

    def differ(name: str, what: str) -> None:
        values = col[name]
        if len(set(values)) > 1 or min(values) < 0:
            per_rank = ", ".join(f"rank {r}: {v if v >= 0 else 'not one row a sample'}" for r, v in enumerate(values))
            raise on_every_rank(ValueError(f"{where}: every rank's batch must have the same {what} ({per_rank})"))

    differ("samples", "number of samples (a last partial batch on some ranks only: drop it, as drop_last=True does)")
    if len(set(col["features"])) > 1 or len(set(col["feature_names_crc"])) > 1:
        names: List[Any] = [None] * env.world
        dist.all_gather_object(names, sorted(raw.sparse_features.keys()) if raw is not None else None,
                               group=env.scheduling_group)
        odd = next(r for r in range(env.world) if names[r] != names[0])
        raise on_every_rank(ValueError(
            f"{where}: every rank's batch must have the same features (in any order); rank 0's KJT has "
            f"{names[0]}, rank {odd}'s {names[odd]}"))
    differ("dense_columns", "number of dense features (dense_features of shape [samples, columns])")
    differ("label_values", "number of label values per sample (labels of shape [samples] or [samples, tasks])")
    odd = [r for r, c in enumerate(col["content_crc"]) if c != col["content_crc"][0]]
    if described.whole and odd:  # (each rank would train its slice of a batch that is not the others')
        raise on_every_rank(ValueError(
            f"{where}: pipeline.global_batches=true says every rank's loader yields the same whole global batch, but "
            f"the labels or dense features of rank(s) {odd} differ from rank 0's; a loader of each rank's own batches "
            f"needs global_batches=false (or null)"))
    return True


@register_stage("keys", 10)
def keys_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """The loader's batch in ``ctx.batch`` becomes the keyed batch (:func:`key_batch`)."""
    assert ctx.batch is not None
    key_batch(host.env, ctx, ctx.batch, host.strategy.whole_batches)


def key_batch(env: SchedulingEnv, ctx: HeraldBatchContext, raw: Batch, whole_batch: bool) -> None:
    """Fill ``ctx.batch``, ``ctx.keys``, ``ctx.bad`` and ``ctx.sample_of_key`` from ``raw``.

    ``whole_batch``: every rank holds the same global batch, so a bad id is raised here by every rank
    alike, naming the rank whose share held it; otherwise it is recorded in ``ctx.bad`` for the
    allocate stage's exchange (``ctx.keys`` is then None)."""
    # (own batches were checked by every rank already, CheckedOwnBatches; a whole global batch is every rank's,
    # so all raise alike)
    if not isinstance(raw, Batch):
        raise on_every_rank(TypeError(f"HeraldTrainPipeline: the data loader yielded {type(raw).__name__} where "
                                      f"{_A_BATCH} is expected"))
    if raw.sparse_features.weights_or_none() is not None:
        raise on_every_rank(ValueError(f"HeraldTrainPipeline: the batch's KJT carries per-sample weights; "
                                       f"{env.ebc.no_weights()}"))
    if raw.labels.device.type != "cpu":  # scheduling runs on CPU: a batch the loader put on the device comes back
        raw = raw.to(torch.device("cpu"))
    full = env.ebc.batch_feature_order(raw.sparse_features)  # herald's features first, any others after
    F = len(env.ebc.layout.features)
    kjt = full if len(full.keys()) == F else full.split([F, len(full.keys()) - F])[0]
    B = kjt.stride()
    lay = env.layout
    ctx.batch = Batch(dense_features=raw.dense_features, sparse_features=full, labels=raw.labels)
    native = load_if_built()
    if native is not None:
        keys, sample, invalid = native.batch_keys(kjt.values(), kjt.lengths(), lay.feature_offsets,
                                                  lay.rows_per_feature, B)
        if not int(invalid):  # (a bad id: the torch ops below find and name it)
            ctx.keys, ctx.bad, ctx.sample_of_key = keys, (0, 0, 0), sample
            return
    values, lengths = kjt.values().to(torch.int64), kjt.lengths().to(torch.int64)
    # the id check and the keys from one bag index per id (which also gives its sample)
    bag = torch.repeat_interleave(lengths)
    feature = bag // B
    invalid = out_of_table(values, lay.rows_per_feature, feature)
    bad = first_invalid_id(values, lengths, lay.rows_per_feature, B) if bool(invalid.any()) else None
    if bad and whole_batch:  # every rank sees the same global batch: all raise the same error
        local_batch = B // env.world
        ranks = torch.unique((bag % B)[invalid] // local_batch).tolist()
        raise on_every_rank(env.ebc.bad_id_error(ranks, bad[0], bad[1]))
    ctx.keys = None if bad else lay.feature_offsets.index_select(0, feature) + values
    ctx.bad = (1, bad[0], bad[1]) if bad else (0, 0, 0)
    ctx.sample_of_key = bag % B
