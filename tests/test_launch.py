"""``torchrec_herald.launch``: a failed rank becomes one line, the root cause's message, or the rank's exit
code (signal) and log file when it died without writing torchelastic's error file."""

from __future__ import annotations

import json
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
