"""The code path a GPU takes, on this CPU: ids and rows handled by torch ops, not the compiled passes.

The compiled passes (``native/``) run only where ids or rows are on the host. On a GPU the id split and the
row store run as torch ops (each a launch), so a benchmark that wants the GPU's host work without a GPU turns
the compiled passes off with :func:`use_gpu_code_path` before building the model, which
:func:`build_training` builds as the trainer does.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple


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


def build_training(overrides: List[str], batch_size: int, batches: int) -> Tuple[int, int, Any, Iterator[Any]]:
    """The trainer's own model, plan and pipeline for ``overrides`` at ``batch_size`` samples a rank, on this
    process's rank (``init_distributed``: one rank alone, or torchrun's), without eval: (the rank, the world
    size, the pipeline, an iterator over this rank's first ``batches`` batches, made before it returns)."""
    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline

    cfg = compose_config([f"batch_size={batch_size}", "eval=false"] + overrides)
    rank, world, device = init_distributed()
    data = build_data_source(cfg.data)
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, device)
    pipeline = build_pipeline(cfg, dmp, optimizer, device, decision)
    return rank, world, pipeline, iter([b for _, b in zip(range(batches), data.train_batches(rank, world, batch_size))])
