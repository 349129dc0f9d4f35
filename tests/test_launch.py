"""``torchrec_herald.launch``: a failed rank becomes one line, the root cause's message, or the rank's exit
code (signal) and log file when it died without writing torchelastic's error file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

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
    killed = "exit code -9 (SIGKILL: out of memory? the kernel's OOM killer sends it (dmesg names it), as does kill -9)"
    assert failure_line(1, failure, "run7") == (f"rank 1 died with {killed} before reporting an error; "
                                                "its log: outputs/run7/logs/rank1.log")
    assert failure_line(0, failure, None) == f"rank 0 died with {killed} before reporting an error"


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
    for code in (-11, -7):  # SIGSEGV, SIGBUS: a crash of its own, the root cause even after the peer's error
        segv = ProcessFailure(local_rank=0, pid=12, exitcode=code, error_file=str(tmp_path / "none.json"))
        segv.timestamp = peer.timestamp + 5
        assert root_failure({0: segv, 1: peer}) == (0, segv), code


def test_two_failures_in_one_second_go_by_the_exact_time_each_rank_recorded(tmp_path: Path) -> None:
    """Torchelastic's timestamps are whole seconds; herald's error file records the exact time of failure, so of
    two errors in one second the first is the root cause, whichever rank it was on (the lower rank was blamed)."""
    from torchrec_herald.launch import root_failure

    failures = {}
    for rank, (when, message) in enumerate(((1000.9, "RuntimeError: Connection closed by peer"),
                                            (1000.2, "ValueError: data.paths: no such file"))):
        script = ("import time, torchrec_herald.train as t\n"
                  f"time.time = lambda: {when}\n"
                  f"t.fail({message.split(': ')[0]}({message.split(': ', 1)[1]!r}), None)\n")
        error_file = tmp_path / f"error{rank}.json"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RANK": str(rank), "TORCHELASTIC_ERROR_FILE": str(error_file)})
        assert done.returncode == 1, done.stderr
        failures[rank] = ProcessFailure(local_rank=rank, pid=rank, exitcode=1, error_file=str(error_file))
    assert [f.timestamp for f in failures.values()] == [1000, 1000]
    assert root_failure(failures) == (1, failures[1])
    assert failure_line(1, failures[1]) == "ValueError: data.paths: no such file"
    other = tmp_path / "other.json"  # (an error file of another writer, no exact time: after those that record one)
    other.write_text(json.dumps({"message": {"message": "x", "extraInfo": {"timestamp": "1000"}}}))
    failures[0] = ProcessFailure(local_rank=0, pid=0, exitcode=1, error_file=str(other))
    assert root_failure(failures) == (1, failures[1])


def test_the_launcher_stopped_by_a_signal_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C on ``torchx run`` printed torchelastic's SignalException traceback beside torchx's own."""
    import signal

    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from torchrec_herald import launch

    def stopped(args: object) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(torch.distributed.run, "run", stopped)
    with pytest.raises(SystemExit) as exit_:
        launch.main(["--nproc_per_node", "1", "train.py"])
    assert exit_.value.code == 130
    assert capsys.readouterr().err == ("torchrec_herald.launch: stopped by signal SIGINT (the ranks were stopped too; a "
                                       "run with checkpoints resumes from its latest by the same command)\n")


def _launch_as_hosts(folders: List[Path], nproc: int, overrides: List[str], timeout_s: float = 180
                     ) -> List[subprocess.CompletedProcess]:
    """``python -m torchrec_herald.launch`` once per folder, each launcher as one host of one job (torchrun's static
    rendezvous on this machine, ``nproc`` ranks each, started in its folder): each launcher's exit code and output.
    Each launcher's session is killed at the end, its ranks too where one still waits."""
    from torchrec_herald.dist_utils import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HERALD_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torchrec_herald.launch", "--nnodes", str(len(folders)), "--node-rank", str(node),
         "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
         "torchrec_herald.train", *overrides],
        cwd=f, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node, f in enumerate(folders)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in launchers]
    finally:
        for p in launchers:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(launchers, outs)]


def test_a_check_failing_on_one_host_stops_the_other_hosts_ranks_naming_it(tmp_path: Path) -> None:
    """Two launchers, as on two hosts (torchrun's static rendezvous, one rank each), given a relative data file that
    only the first one's folder holds: the second host's rank fails its checks. It ended at once while rank 0, on
    the other host, waited for it in the process group's set-up until its timeout (600 s) and then named a timeout.
    Both launchers now end within seconds, and rank 0's says which rank and host failed and why."""
    import socket

    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for h in hosts:
        h.mkdir()
    (hosts[0] / "day_0.tsv").write_text("\n".join([good] * 16) + "\n")
    done = _launch_as_hosts(hosts, 1, ["data=criteo_tsv", "data.paths=[day_0.tsv]", "batch_size=2", "eval=false"])
    outs = [d.stdout for d in done]
    assert [d.returncode for d in done] == [1, 1], outs
    peer = [line for line in outs[0].splitlines() if "failed its checks before training" in line]
    assert len(peer) == 1 and peer[0].startswith(
        f"torchrec_herald.train failed on rank 0: PeerCheckFailed: rank 1 on host {socket.gethostname()} failed its "
        f"checks before training: FileNotFoundError: data file(s) not found: day_0.tsv (its traceback: "), outs[0]
    assert peer[0].endswith(f"/logs/rank1.log on {socket.gethostname()})"), peer[0]  # (not rank 0's own log)
    assert "FileNotFoundError" in outs[1] and "day_0.tsv" in outs[1], outs[1]


def test_a_job_on_two_hosts_trains_the_same_losses_as_on_one(tmp_path: Path) -> None:
    """One rank on each of two launchers (two hosts to torchrun: LOCAL_WORLD_SIZE 1 of WORLD_SIZE 2, a topology of
    two hosts to TorchRec's planner), herald's plan and pipeline with checkpoints in one folder both reach: the same
    per-step losses, bit for bit, as both ranks under one launcher. No test ran ranks of one job under two launchers."""
    common = ["data.num_train_batches=8", "data.num_eval_batches=1", "batch_size=32", "eval=false", "planner=herald",
              "planner.link_mbit=null", "pipeline=herald", "pipeline.window=2", "checkpoint.every_n_steps=4"]
    two = _launch_as_hosts([tmp_path, tmp_path], 1, common + [f"checkpoint.dir={tmp_path / 'ckpt_two'}",
                                                             "hydra.run.dir=two"])
    assert [d.returncode for d in two] == [0, 0], [d.stdout[-3000:] for d in two]
    one = _launch_as_hosts([tmp_path], 2, common + [f"checkpoint.dir={tmp_path / 'ckpt_one'}", "hydra.run.dir=one"])
    assert one[0].returncode == 0, one[0].stdout[-3000:]
    losses = [json.loads((tmp_path / run / "losses.json").read_text()) for run in ("two", "one")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    saved = [sorted(p.name for p in (tmp_path / ckpt).iterdir()) for ckpt in ("ckpt_two", "ckpt_one")]
    assert saved[0] == saved[1] == ["losses.json", "metrics.json", "step_00000004", "step_00000008"]


@pytest.mark.parametrize("line, nnodes, noted", [
    ("RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711", "2", True),
    ("RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711", "1:4", True),
    ("RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:4711", "1", False),
    ("ValueError: data.paths: no such file", "2", False)])
def test_a_lost_peer_on_a_job_spanning_hosts_says_the_cause_may_be_on_another_host(line: str, nnodes: str,
                                                                                   noted: bool) -> None:
    """Each host's launcher sees only its own ranks: a rank killed on one host shows on the others as a connection
    closed by a peer, which their launchers named as the root cause."""
    from torchrec_herald.launch import across_hosts

    note = " (a peer's connection failed: the cause may be on another host; see the other hosts' launchers)"
    assert across_hosts(line, nnodes) == line + (note if noted else "")


def test_a_rank_stopped_by_a_peers_failed_check_gives_way_to_that_peers_own_error(tmp_path: Path) -> None:
    """Rank 1's check failed and rank 0 stopped naming it (PeerCheckFailed), at about the same moment: the launcher
    showed whichever wrote first. Rank 1's own error goes first."""
    from torchrec_herald.launch import root_failure

    def failed(rank: int, message: str, at: float) -> ProcessFailure:
        f = tmp_path / f"error{rank}.json"
        f.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1",
                                                                                "herald_failed_at": repr(at)}}}))
        return ProcessFailure(local_rank=rank, pid=7 + rank, exitcode=1, error_file=str(f))

    peer = failed(0, "PeerCheckFailed: rank 1 on host h failed its checks before training: FileNotFoundError: x", 1.0)
    own = failed(1, "FileNotFoundError: data file(s) not found: x", 2.0)
    assert root_failure({0: peer, 1: own})[0] == 1
    assert root_failure({0: peer})[0] == 0  # (where this host has no other: that line, which names the peer)
