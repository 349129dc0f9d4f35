"""The launcher the torchx component runs: ``torch.distributed.run`` (torchrun) whose failure is one line.

torchrun reports a failed rank with an error log line, its own 20-line traceback and a summary that
repeats the cause for every rank. This entry point runs the very same launcher (``torch.distributed.run.
run``) and, when a rank fails, prints one line instead: the root cause (the first rank to fail, from
torchelastic's error file, which ``torchrec_herald.train`` fills with ``<Type>: <message naming the key,
file or line> (traceback: <the rank's log>)``), or the rank's exit code and log file where it died
without one (a signal, an out-of-memory kill). The error file is handed up as torchrun's ``@record``
does, so torchx's final status names the same cause.

    python -m torchrec_herald.launch <torchrun arguments> -m torchrec_herald.train <overrides>
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["across_hosts", "failure_line", "main", "root_failure"]

#: torchelastic's own reports of a failure, which the one line below replaces
_ELASTIC_FAILURE_LOGS = ("failed (exitcode", "Sending process")


def _quiet_elastic_failure_logs() -> None:
    class _DropFailureReports(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith(_ELASTIC_FAILURE_LOGS)

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropFailureReports())


def _message(failure: object) -> str:
    """The message of ``failure``'s error file ('' without one)."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # the structured form torchelastic's ErrorHandler writes
        message = message.get("message", "")
    return message if _has_error_file(failure) and isinstance(message, str) else ""


def failure_line(rank: int, failure: object, run_id: Optional[str] = None) -> str:
    """One line for a failed rank: its error file's message, else its exit code (or signal) and, when
    the run's rank log exists, its path (``outputs/<run id>/logs/rank<r>.log``)."""
    message = _message(failure)
    if message.strip():
        return " ".join(message.split())
    exitcode = getattr(failure, "exitcode", None)
    how = f"exit code {exitcode}"
    if isinstance(exitcode, int) and exitcode < 0:
        how += f" ({failure.signal_name()}"  # type: ignore[attr-defined]
        how += ": out of memory? the kernel's OOM killer sends it (dmesg names it), as does kill -9)" if exitcode == -9 \
            else ")"
    log = Path("outputs") / (run_id or "") / "logs" / f"rank{rank}.log"
    where = f"; its log: {log}" if run_id and log.is_file() else ""
    return f"rank {rank} died with {how} before reporting an error{where}"


def _has_error_file(failure: object) -> bool:
    path = getattr(failure, "error_file", None)
    return isinstance(path, str) and os.path.isfile(path)


def _dump_error_file_atomically(handler: object, child_file: str, exitcode: int) -> None:
    """The root cause's error file as the launcher's (``$TORCHELASTIC_ERROR_FILE``), as torch's
    ``ErrorHandler.dump_error_file`` writes it but replaced in one rename: torchx's status poll may read
    the file while it is being written (a torn read fails its JSON parse with a traceback)."""
    import json

    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return
    with open(child_file) as fp:
        data = json.load(fp)
    if exitcode:  # a child killed by a signal cannot record its own exit code
        handler.override_error_code_in_rootcause_data(child_file, data, exitcode)  # type: ignore[attr-defined]
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as fp:
        json.dump(data, fp)
    os.replace(tmp, target)


#: exit codes of a rank lost to a signal of its own (SIGKILL: the OOM killer or a kill; SIGSEGV; SIGBUS), not the
#: abort or termination that follows a peer's failure (NCCL's watchdog aborts; torchrun terminates the others)
_LOST = (-9, -11, -7)


#: the exact time of failure herald's error file records (``extraInfo``), beside torchelastic's whole-second
#: ``timestamp``
FAILED_AT_KEY = "herald_failed_at"


def root_failure(failures: Dict[int, Any]) -> Tuple[int, Any]:
    """The rank whose failure to report: one killed by SIGKILL, SIGSEGV or SIGBUS (a lost rank: the others'
    errors, a peer's connection reset, follow from it), else the first to fail, leaving out ranks torchrun
    terminated (SIGTERM, no error of their own) because another failed first. Torchelastic's first failure goes
    by its whole-second timestamps, and a rank killed by a signal gets its timestamp when the agent notices it,
    after its peers' error files. Two failures in one second go by the exact time herald's error file records
    (:func:`torchrec_herald.train.fail`), else by rank."""
    killed = sorted(r for r, f in failures.items() if getattr(f, "exitcode", None) in _LOST)
    if killed:
        return killed[0], failures[killed[0]]
    # (only a rank torchrun terminated, SIGTERM without an error of its own, gives way: a rank that died of
    # another signal, or exited without an error file, may be the cause)
    reported = [r for r, f in failures.items()
                if _has_error_file(f) or getattr(f, "exitcode", None) != -15] or list(failures)
    # (a rank that stopped because a peer's check failed names that peer's error: the peer's own line, where this
    # host has it, goes first)
    reported = [r for r in reported if not _message(failures[r]).startswith("PeerCheckFailed:")] or reported
    rank = min(reported, key=lambda r: (getattr(failures[r], "timestamp", 0), _failed_at(failures[r]), r))
    return rank, failures[rank]


#: what a rank's error says when a peer's connection failed: its cause, on a job spanning hosts, may be elsewhere
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
              "nccl error", "ncclremoteerror")


def across_hosts(line: str, nnodes: str) -> str:
    """``line``, with a note where this launcher is one of several hosts' (``--nnodes`` above 1) and its rank's error
    is a peer's connection lost: each host's launcher sees only its own ranks, so the root cause (a rank killed, a
    host lost) may be another host's, named by that host's launcher."""
    most = nnodes.split(":")[-1]
    error = line.split(" (traceback: ", 1)[0].lower()  # (the error's own words, not its log's path)
    if not most.isdigit() or int(most) < 2 or not any(s in error for s in _PEER_LOST):
        return line
    return line + " (a peer's connection failed: the cause may be on another host; see the other hosts' launchers)"


def _failed_at(failure: object) -> float:
    """The exact time herald's error file records for ``failure`` (``inf`` without one: an error file of
    another writer, or none)."""
    message = getattr(failure, "message", None)
    info = message.get("extraInfo") if isinstance(message, dict) else None
    try:
        return float(info[FAILED_AT_KEY]) if _has_error_file(failure) and isinstance(info, dict) else float("inf")
    except (KeyError, TypeError, ValueError):
        return float("inf")


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
    from torch.distributed.run import parse_args, run

    _quiet_elastic_failure_logs()
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        if _has_error_file(failure):  # torchx's status reads the launcher's error file: the root cause's
            _dump_error_file_atomically(get_error_handler(), failure.error_file, failure.exitcode)
        line = failure_line(rank, failure, os.environ.get("HERALD_RUN_ID"))
        sys.stderr.write(f"{e.name} failed on rank {rank}: {across_hosts(line, str(args.nnodes))}\n")
        sys.stderr.flush()
        sys.exit(1)
    except SignalException as e:  # Ctrl-C or a kill of the launcher: its ranks are stopped; one line, no traceback
        sys.stderr.write(f"torchrec_herald.launch: stopped by signal {e.sigval.name} (the ranks were stopped too; a "
                         f"run with checkpoints resumes from its latest by the same command)\n")
        sys.stderr.flush()
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
