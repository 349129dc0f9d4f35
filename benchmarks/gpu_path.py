"""The code path a GPU takes, on this CPU: ids and rows handled by torch ops, not the compiled passes.

The compiled passes (``native/``) run only where ids or rows are on the host. On a GPU the id split and the
row store run as torch ops (each a launch), so a benchmark that wants the GPU's host work without a GPU turns
the compiled passes off with :func:`use_gpu_code_path` before building the model.
"""

from __future__ import annotations

from typing import Any


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
