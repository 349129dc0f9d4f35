"""Build herald's compiled scheduler (``make setup`` runs it): ``python -m torchrec_herald.native.build``.

Compiles the sources of ``torchrec_herald.native.SOURCES`` (the planner by home, the global plans, the plan
executor's row access, hot replication's id bookkeeping, the input allocator's greedy, the synthetic data's
sampling, a batch's keys and reads) against the installed torch with
``torch.utils.cpp_extension`` (ninja and a C++ compiler) into ``torchrec_herald/native/_build``. A missing tool or a failed compile prints one line
naming it (and the log's path) and exits 1; nothing is compiled at run time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from torchrec_herald.native import BUILD_DIR, MODULE, SOURCES, source_sha

__all__ = ["NativeBuildError", "build", "find_compiler"]


class NativeBuildError(RuntimeError):
    """The compiled scheduler could not be built (one line: the missing tool or the first compile error)."""


def find_compiler() -> Optional[str]:
    """The C++ compiler torch's build will use: ``$CXX``, else ``c++``, else ``g++`` (a path), or None."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("c++") or shutil.which("g++")


def build(verbose: bool = False) -> Path:
    """Build (or find up to date) the extension; returns the shared object's path."""
    import torch
    from torch.utils import cpp_extension

    cxx = find_compiler()
    if cxx is None:
        wanted = os.environ.get("CXX") or "c++ or g++"
        raise NativeBuildError(f"no C++ compiler: {wanted} is not on PATH; install one (e.g. apt-get install g++) "
                               "or set CXX, then re-run `make setup` (or use pipeline.scheduler_impl=python)")
    if shutil.which("ninja") is None:
        raise NativeBuildError("ninja is not on PATH (torch builds C++ extensions with it): install it "
                               "(apt-get install ninja-build, or pip install ninja), then re-run `make setup`")
    os.environ["CXX"] = cxx
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    log = BUILD_DIR / "build.log"
    flags = ["-O3", f'-DHERALD_NATIVE_SOURCE_SHA=\\"{source_sha()}\\"', f'-DHERALD_NATIVE_TORCH=\\"{torch.__version__}\\"']
    try:
        cpp_extension.load(name=MODULE, sources=[str(s) for s in SOURCES], build_directory=str(BUILD_DIR), extra_cflags=flags,
                           verbose=verbose, is_python_module=True)
    except (RuntimeError, OSError) as e:
        log.write_text(str(e))
        first = next((ln.strip() for ln in str(e).splitlines() if "error:" in ln), str(e).splitlines()[0] if str(e) else "")
        raise NativeBuildError(f"building herald's compiled scheduler failed: {first} (full log: {log})") from None
    so = BUILD_DIR / f"{MODULE}.so"
    if not so.exists():
        raise NativeBuildError(f"building herald's compiled scheduler left no {so} (see {log})")
    return so


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    a = p.parse_args(argv)
    try:
        so = build(a.verbose)
    except NativeBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from torchrec_herald.native import load

    load()  # the source hash and torch version it was built for match
    print(f"herald's compiled scheduler: {so}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
