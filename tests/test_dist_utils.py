"""``torchrec_herald.dist_utils.run_multiprocess``: ranks forked from a fork server that imported torch and
TorchRec once still run with the caller's environment and working directory of the moment they start,
and a rank's failure or silent death is raised in the caller."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from torchrec_herald.dist_utils import run_multiprocess


def _probe(rank: int, world: int) -> Tuple[Optional[str], str, bool, int]:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return os.environ.get("HERALD_TEST_PROBE"), os.getcwd(), "torchrec" in sys.modules, int(t)


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1's own message")


def _exit_on_rank_0(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)


def test_ranks_get_the_callers_environment_and_directory_set_after_the_fork_server_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERALD_TEST_PROBE", raising=False)
    first = run_multiprocess(_probe, 2)  # starts the fork server (or reuses the suite's)
    assert [r[0] for r in first] == [None, None] and [r[3] for r in first] == [3, 3]
    monkeypatch.setenv("HERALD_TEST_PROBE", "set after")
    monkeypatch.chdir(tmp_path)
    assert run_multiprocess(_probe, 2) == [("set after", str(tmp_path), True, 3)] * 2


def test_a_ranks_exception_is_raised_in_the_caller_with_its_message() -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: rank 1's own message"):
        run_multiprocess(_fail_on_rank_1, 2)


def test_a_rank_that_exits_without_reporting_is_named() -> None:
    with pytest.raises(RuntimeError, match="rank 0 exited with code 3 without reporting a result"):
        run_multiprocess(_exit_on_rank_0, 2, timeout_s=60)


@pytest.mark.parametrize("gpus,local_world,env,backend,devices", [
    (0, 2, None, "gloo", ["cpu", "cpu"]),
    (1, 1, None, "cpu:gloo,cuda:nccl", ["cuda:0"]),
    (2, 2, None, "cpu:gloo,cuda:nccl", ["cuda:0", "cuda:1"]),
    (1, 2, "gloo", "gloo", ["cuda:0", "cuda:0"]),  # two ranks sharing one GPU (NCCL would refuse it)
    (2, 4, "gloo", "gloo", ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
])
def test_the_backend_is_chosen_and_ranks_beyond_the_visible_gpus_share_them(
        monkeypatch: pytest.MonkeyPatch, gpus: int, local_world: int, env: Optional[str], backend: str,
        devices: list) -> None:
    from torchrec_herald.dist_utils import BACKEND_ENV, default_backend, local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if env is None:
        monkeypatch.delenv(BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(BACKEND_ENV, env)
    got = []
    for local in range(local_world):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert default_backend() == backend
        got.append(str(local_device()))
    assert got == devices


def test_an_unknown_backend_is_one_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrec_herald.dist_utils import default_backend

    for chosen in ("mpi", "nccl"):  # (nccl alone: the trainer's CPU reductions would have no backend, at its end)
        monkeypatch.setenv("HERALD_DIST_BACKEND", chosen)
        with pytest.raises(ValueError) as e:
            default_backend()
        assert str(e.value) == (f"HERALD_DIST_BACKEND='{chosen}': expected one of ['gloo', 'cpu:gloo,cuda:nccl'] "
                                f"(cpu:gloo,cuda:nccl: NCCL for CUDA tensors, gloo for the trainer's CPU ones; the "
                                f"default on a GPU host)")
