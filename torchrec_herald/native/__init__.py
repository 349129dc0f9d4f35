"""herald's compiled scheduler: the per-rank lazy plan (planning by home) as a C++ torch extension,
``herald_native``, built once by ``make setup`` (``python -m torchrec_herald.native.build``) into
``torchrec_herald/native/_build``. Nothing is compiled at run time: :func:`load` imports the built module
and refuses one built from another source or against another torch, saying how to rebuild."""

from __future__ import annotations

import hashlib
import importlib.util
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Optional

__all__ = ["BUILD_DIR", "HEADERS", "SOURCE", "SOURCES", "NativeUnavailable", "available", "load", "load_if_built",
           "source_sha", "unavailable_reason"]

SOURCE = Path(__file__).with_name("home_split.cpp")  # the module's entry point (its pybind11 module)
#: every source compiled into the module (the planner by home, the global plans, the plan executor's row
#: access, hot replication's id bookkeeping, the input allocator's greedy, the synthetic data's sampling, a
#: batch's keys and reads)
#: and the header they share; all of them make up the build's source hash
SOURCES = (SOURCE, Path(__file__).with_name("row_store.cpp"), Path(__file__).with_name("global_plan.cpp"),
           Path(__file__).with_name("id_split.cpp"), Path(__file__).with_name("greedy_assign.cpp"),
           Path(__file__).with_name("synthetic_sample.cpp"), Path(__file__).with_name("batch_keys.cpp"))
HEADERS = (Path(__file__).with_name("common.h"),)
BUILD_DIR = Path(__file__).with_name("_build")
MODULE = "herald_native"
HOW_TO_FIX = "run `make setup` (or `python -m torchrec_herald.native.build`), or set pipeline.scheduler_impl=python"


class NativeUnavailable(RuntimeError):
    """The compiled scheduler is not built, or was built from another source or torch."""


def source_sha() -> str:
    """The first 16 hex digits of the source's sha256 (compiled into the module)."""
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def built_path() -> Optional[Path]:
    """The built shared object, if any."""
    hits = sorted(BUILD_DIR.glob(f"{MODULE}*.so"))
    return hits[0] if hits else None


@lru_cache(maxsize=1)
def _load() -> ModuleType:
    import torch  # the module links against the libtorch this process loaded

    path = built_path()
    if path is None:
        raise NativeUnavailable(f"herald's compiled scheduler is not built ({BUILD_DIR}/{MODULE}.so is missing): {HOW_TO_FIX}")
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:
        raise NativeUnavailable(f"herald's compiled scheduler {path} does not load ({e}): {HOW_TO_FIX}") from None
    if mod.SOURCE_SHA != source_sha():
        raise NativeUnavailable(f"herald's compiled scheduler {path} was built from another version of "
                                f"{', '.join(p.name for p in SOURCES + HEADERS)}: "
                                f"{HOW_TO_FIX}")
    if mod.TORCH_VERSION != torch.__version__:
        raise NativeUnavailable(f"herald's compiled scheduler {path} was built against torch {mod.TORCH_VERSION}, "
                                f"this is torch {torch.__version__}: {HOW_TO_FIX}")
    return mod


def load() -> ModuleType:
    """The compiled module (:class:`NativeUnavailable`, one line saying how to build it, if it cannot be used)."""
    return _load()


def load_if_built() -> Optional[ModuleType]:
    """The compiled module, or None where it cannot be used (the callers' torch ops run instead)."""
    try:
        return load()
    except NativeUnavailable:
        return None


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` would fail, or None."""
    try:
        load()
    except NativeUnavailable as e:
        return str(e)
    return None


def available() -> bool:
    """The compiled scheduler loads."""
    return unavailable_reason() is None
