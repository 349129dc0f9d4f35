"""The code path a GPU takes, on this CPU: ids and rows handled by torch ops, not the compiled passes.

The compiled passes (``native/``) run only where ids or rows are on the host. On a GPU the id split and the
row store run as torch ops (each a launch), so a benchmark that wants the GPU's host work without a GPU turns
the compiled passes off with :func:`use_gpu_code_path` before building the model, which
:func:`build_training` builds as the trainer does.

:func:`build_training` feeds the pipeline as the trainer does by default (``loader="stream"``): a
:class:`~torchrec_herald.data.base.TrainStream`, over batches made before timing starts
(:class:`PreloadedBatches`), so that herald's pipeline reads whole global batches and schedules them on its
run-ahead thread, as ``python -m torchrec_herald.train`` does. ``loader="own"`` feeds a plain iterator over
this rank's batches, as a TorchRec user's own data loader does: herald then gathers every rank's scores and
reads and exchanges samples (scheduled ahead too, unless ``pipeline.run_ahead=false``, the order of every GPU
figure of herald full up to 2026-11-27).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

from torchrec.datasets.utils import Batch

from torchrec_herald.data.base import DataSource, check_start

#: what feeds the pipeline: the trainer's TrainStream (its default), or this rank's batches as a user's own loader
LOADERS = ("stream", "own")
#: batches made beyond the steps taken and herald's window: TorchRec's pipelines read up to two ahead, and
#: herald's run-ahead thread one more
READ_AHEAD = 4


def use_gpu_code_path(no_extension: bool = False) -> None:
    """From now on, herald modules built in this process take the GPU's path: the input dist's split by
    torch ops, and the row store's gathers and scatters by torch ops (finding a key's row stays compiled,
    as on a GPU host where the extension is built, unless ``no_extension``)."""
    import torchrec_herald.sharding.hot_replicated as hot_replicated
    import torchrec_herald.sharding.row_store as row_store

    hot_replicated.load_if_built = lambda: None  # type: ignore[assignment]
    init = row_store.RowStore.__init__

    def gpu_rows_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self.native = None
        if no_extension:
            self.native_locate = None

    row_store.RowStore.__init__ = gpu_rows_init  # type: ignore[method-assign]


def add_loader_argument(parser: Any) -> None:
    """The ``--loader`` option of the benchmarks that build with :func:`build_training`."""
    parser.add_argument("--loader", choices=LOADERS, default="stream",
                        help="what feeds the pipeline: the trainer's TrainStream (herald schedules whole global "
                             "batches on its run-ahead thread, as python -m torchrec_herald.train does) or this "
                             "rank's batches in a plain iterator, as a TorchRec user's own loader (herald then "
                             "gathers scores and reads and moves samples; add pipeline.run_ahead=false for the "
                             "order of the GPU figures of herald full up to 2026-11-27)")


def add_training_arguments(parser: Any, batch_size: int, steps: int, warmup: int) -> None:
    """The options every per-step benchmark built by :func:`build_training` takes: the trainer's Hydra
    overrides, the batch size a rank, the steps timed after a warm-up, the GPU's code path and the feed."""
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the trainer's config")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--torch-ids", action="store_true",
                        help="the torch ops, not the compiled passes (a GPU's path)")
    add_loader_argument(parser)


class PreloadedBatches(DataSource):
    """The first ``batches`` global batches of ``source``, made now and kept in memory, in the two shapes a
    run reads: this rank's slice and, where ``whole``, the whole global batch (a herald pipeline scheduling
    whole global batches reads those). Seekable, as the trainer's sources: a :class:`TrainStream` over it
    switches between the two shapes as the pipeline asks. Data generation is thus out of the timing."""

    def __init__(self, source: DataSource, rank: int, world: int, batch_size: int, batches: int,
                 whole: bool) -> None:
        self.feature_names, self.num_embeddings, self.num_dense = (
            source.feature_names, source.num_embeddings, source.num_dense)
        self._source = source
        shapes = [(rank, world, batch_size)] + ([(0, 1, world * batch_size)] if whole else [])
        self._batches: Dict[Tuple[int, int, int], List[Batch]] = {}
        for shape in shapes:
            got = [b for _, b in zip(range(batches), source.train_batches(*shape))]
            if len(got) < batches:
                raise ValueError(f"{source.describe()} yields {len(got)} batches of {shape[2]}; {batches} needed")
            self._batches[shape] = got

    def train_batches_from(self, rank: int, world_size: int, batch_size: int, start: int) -> Iterator[Batch]:
        key = (rank, world_size, batch_size)
        if key not in self._batches:
            raise ValueError(f"PreloadedBatches holds the shapes {sorted(self._batches)}, not {key}")
        return iter(self._batches[key][check_start(start):])

    def train_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        return self.train_batches_from(rank, world_size, batch_size, 0)

    def eval_batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[Batch]:
        raise ValueError("PreloadedBatches holds train batches only (the benchmarks build without eval)")

    def describe(self) -> str:
        return f"PreloadedBatches({self._source.describe()})"


def build_training(overrides: List[str], batch_size: int, steps: int, loader: str = "stream"
                   ) -> Tuple[int, int, Any, Iterator[Any], Any]:
    """The trainer's own model, plan and pipeline for ``overrides`` at ``batch_size`` samples a rank, on this
    process's rank (``init_distributed``: one rank alone, or torchrun's), without eval: (the rank, the world
    size, the pipeline, an iterator over enough batches for ``steps`` steps, made before it returns, the device).
    ``loader``:
    ``stream``, the trainer's :class:`TrainStream` (whole global batches where herald schedules them);
    ``own``, this rank's batches in a plain iterator (module docstring)."""
    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline, train_stream

    if loader not in LOADERS:
        raise ValueError(f"loader {loader!r}: expected one of {list(LOADERS)}")
    cfg = compose_config([f"batch_size={batch_size}", "eval=false"] + overrides)
    rank, world, device = init_distributed()
    data = build_data_source(cfg.data)
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, device)
    pipeline = build_pipeline(cfg, dmp, optimizer, device, decision)
    batches = steps + READ_AHEAD + int(cfg.pipeline.get("window", 0) or 0)  # (the window's batches are read first)
    if loader == "own":
        own = PreloadedBatches(data, rank, world, batch_size, batches, whole=False)
        return rank, world, pipeline, own.train_batches(rank, world, batch_size), device
    # (the whole global batches too, whatever the pipeline: at one rank they are this rank's batches)
    kept = PreloadedBatches(data, rank, world, batch_size, batches, whole=world > 1)
    return rank, world, pipeline, train_stream(kept, rank, world, batch_size), device
