"""``torchrec_herald.launch``: a failed rank becomes one line, the root cause's message, or the rank's exit
code (signal) and log file when it died without writing torchelastic's error file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchrec_herald.launch import failure_line


def test_a_failure_with_an_error_file_is_its_message_on_one_line(tmp_path: Path) -> None:
    f = tmp_path / "error.json"
    f.write_text(json.dumps({"message": {"message": "ValueError: checkpoint.dir=x is a file,\n not a directory",
                                         "extraInfo": {"timestamp": "1"}}}))
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=1, error_file=str(f))
    assert failure_line(1, failure, "run") == "ValueError: checkpoint.dir=x is a file, not a directory"


def test_a_rank_killed_by_a_signal_names_the_signal_and_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "run7" / "logs").mkdir(parents=True)
    (tmp_path / "outputs" / "run7" / "logs" / "rank1.log").write_text("")
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert failure_line(1, failure, "run7") == ("rank 1 died with exit code -9 (SIGKILL) before reporting an error; "
                                                "its log: outputs/run7/logs/rank1.log")
    assert failure_line(0, failure, None) == "rank 0 died with exit code -9 (SIGKILL) before reporting an error"


def test_a_failing_rank_exits_at_once_while_a_worker_thread_waits(tmp_path: Path) -> None:
    """A run-ahead job may wait in a collective that the other ranks never join: the failing rank must not wait
    for it at exit (a normal exit joins every worker thread, here forever)."""
    script = ("import threading, concurrent.futures as cf\n"
              "from torchrec_herald.train import fail\n"
              "never = threading.Event()\n"
              "cf.ThreadPoolExecutor(1).submit(never.wait)\n"
              "fail(ValueError('data.paths: no such file'), None)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0"})
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (1, "ERROR: ValueError: data.paths: no such file")


def test_a_rank_killed_by_a_signal_is_the_root_cause_before_its_peers_errors(tmp_path: Path) -> None:
    """Rank 0 SIGKILLed: rank 1 then fails with gloo's 'connection reset by peer', and its error file is written
    before the agent notices rank 0 (torchelastic's first failure by timestamp blamed rank 1)."""
    from torchrec_herald.launch import root_failure

    f = tmp_path / "error.json"
    f.write_text(json.dumps({"message": {"message": "RuntimeError: Connection reset by peer",
                                         "extraInfo": {"timestamp": "1"}}}))
    peer = ProcessFailure(local_rank=1, pid=8, exitcode=1, error_file=str(f))
    killed = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file=str(tmp_path / "none.json"))
    killed.timestamp = peer.timestamp + 5
    assert root_failure({0: killed, 1: peer}) == (0, killed)
    assert root_failure({1: peer}) == (1, peer)
    aborted = ProcessFailure(local_rank=0, pid=9, exitcode=-6, error_file=str(tmp_path / "none.json"))  # SIGABRT
    aborted.timestamp = peer.timestamp + 5  # (a watchdog's abort after the peer's failure: not the root cause)
    assert root_failure({0: aborted, 1: peer}) == (1, peer)
    terminated = ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none.json"))
    terminated.timestamp = peer.timestamp - 5  # (torchrun's SIGTERM after the peer's error: no error of its own)
    assert root_failure({0: terminated, 1: peer}) == (1, peer)
    crashed = ProcessFailure(local_rank=0, pid=11, exitcode=-6, error_file=str(tmp_path / "none.json"))  # SIGABRT
    crashed.timestamp = peer.timestamp - 1  # (a C++ abort first; the peer's connection error follows)
    assert root_failure({0: crashed, 1: peer}) == (0, crashed)
