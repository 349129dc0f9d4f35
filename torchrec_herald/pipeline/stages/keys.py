"""Stage 1 of a batch entering the window: the batch on CPU in the EBC's feature order, its ids
validated, their global row keys (``layout.feature_offsets[f] + id``) and each key's sample: one compiled
pass (``native/batch_keys.cpp``) where the module is built, the torch ops below otherwise and to name a
bad id."""

from __future__ import annotations

import torch
from torchrec.datasets.utils import Batch

from torchrec_herald.native import load_if_built
from torchrec_herald.ops.hot_cold import first_invalid_id, out_of_table
from torchrec_herald.pipeline.context import HeraldBatchContext, SchedulingEnv, on_every_rank
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["key_batch", "keys_stage"]


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
