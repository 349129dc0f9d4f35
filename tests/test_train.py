"""Multi-process training through the real driver code (``run_training``) on the default data."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from torchrec_herald.dist_utils import run_multiprocess

SMALL = ["data.num_train_batches=40", "data.num_eval_batches=4", "batch_size=128", "log_every=10"]


def _train(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    cfg = compose_config(overrides)
    metrics = run_training(cfg, Path(run_dir), show_progress=False)
    losses = json.loads((Path(run_dir) / "losses.json").read_text())
    return {"metrics": metrics, "losses": losses}


def test_two_rank_training_loss_decreases_and_metrics_written(tmp_path: Path) -> None:
    res = run_multiprocess(_train, 2, SMALL, str(tmp_path))
    m = res[0]["metrics"]
    assert m["steps"] == 40 and m["world_size"] == 2 and m["global_batch_size"] == 256
    assert m["train_logloss"] < m["train_logloss_first"] - 0.05
    assert 0.55 < m["eval"]["auc"] < 1.0
    assert m["eval"]["samples"] == 4 * 256
    assert m["samples_per_s"] > 0 and m["step_time_s"]["p50"] > 0
    # traffic: the default plan's collectives are all seen, and the total is their sum
    assert m["traffic_per_step"]["all_to_all_single"]["calls"] > 0
    assert m["traffic_per_step"]["all_reduce"]["bytes"] > 0
    assert m["traffic_per_step_total"]["bytes"] == pytest.approx(
        sum(s["bytes"] for s in m["traffic_per_step"].values()))
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["steps"] == 40 and written["plan"] == m["plan"]
    assert (tmp_path / "logs" / "rank0.log").exists() and (tmp_path / "logs" / "rank1.log").exists()
    assert (tmp_path / "training.png").stat().st_size > 0
    # every rank reports the same (reduced) figures
    assert res[1]["metrics"]["traffic_per_step"] == m["traffic_per_step"]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_stock_row_wise_and_table_wise_are_bit_identical(tmp_path: Path, optimizer: str) -> None:
    """The exactness reference (docs/design.md §7): stock ROW_WISE and TABLE_WISE train the same model."""
    common = SMALL[:1] + ["data.num_train_batches=12", "eval=false", f"optimizer={optimizer}"]
    rw = run_multiprocess(_train, 2, common + ["planner=row_wise"], str(tmp_path / "rw"))
    tw = run_multiprocess(_train, 2, common + ["planner=table_wise"], str(tmp_path / "tw"))
    assert set(rw[0]["metrics"]["plan"].values()) == {"row_wise"}
    assert set(tw[0]["metrics"]["plan"].values()) == {"table_wise"}
    assert rw[0]["losses"] == tw[0]["losses"]
    # for one-id features ROW_WISE's reduce-scatter moves W x the embedding vectors of TABLE_WISE
    rw_vec = rw[0]["metrics"]["traffic_per_step_total"]["embedding_vectors"]
    tw_vec = tw[0]["metrics"]["traffic_per_step_total"]["embedding_vectors"]
    assert rw_vec == pytest.approx(2 * tw_vec)


def test_bad_data_fails_on_every_rank_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    bad.write_text("\n".join([good] * 5 + ["0\tnot-a-number"] + [good] * 20) + "\n")
    with pytest.raises(RuntimeError, match=r"bad\.tsv:6: expected 40 tab-separated fields, got 2"):
        run_multiprocess(_train, 2, ["data=criteo_tsv", f"data.paths={bad}", "batch_size=2", "eval=false"],
                         str(tmp_path / "run"), timeout_s=120)


def test_a_bad_eval_file_found_after_training_keeps_the_training_figures(tmp_path: Path) -> None:
    """An eval file is checked only as it is read, after training: its bad record is named on every rank, and
    the trained run's metrics.json and losses.json are written first."""
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train.write_text("\n".join([good] * 24) + "\n")
    evals.write_text("\n".join([good] * 8 + ["0\tnot-a-number"]) + "\n")
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"eval\.tsv:9: expected 40 tab-separated fields, got 2"):
        run_multiprocess(_train, 2, ["data=criteo_tsv", f"data.paths={train}", f"data.eval_paths={evals}",
                                     "batch_size=4"], str(run), timeout_s=120)
    written = json.loads((run / "metrics.json").read_text())
    assert written["steps"] == 3 and written["eval"] == {}
    assert len(json.loads((run / "losses.json").read_text())) == 3


def test_a_finished_run_is_evaluated_again_after_a_bad_eval_file_is_fixed_or_the_split_changes(tmp_path: Path
                                                                                                 ) -> None:
    """Re-running a finished run reports its figures; where its eval did not finish (a bad eval file, then fixed)
    or the eval split changed, the finished model is evaluated on the split given now, nothing retrains; where
    the figures beside its checkpoints are another attempt's, one line says so."""
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train.write_text("\n".join([good] * 24) + "\n")
    evals.write_text("\n".join([good] * 8 + ["0\tnot-a-number"]) + "\n")
    common = ["data=criteo_tsv", f"data.paths={train}", f"data.eval_paths={evals}", "batch_size=4",
              "checkpoint.every_n_steps=3", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    with pytest.raises(RuntimeError, match=r"eval\.tsv:9"):
        run_multiprocess(_train, 2, common, str(tmp_path / "run1"), timeout_s=120)
    evals.write_text("\n".join([good] * 8) + "\n")  # fixed
    fixed = run_multiprocess(_train, 2, common, str(tmp_path / "run2"), timeout_s=120)[0]["metrics"]
    assert fixed["steps"] == 3 and fixed["steps_this_attempt"] == 3 and fixed["eval"]["samples"] == 8
    other = tmp_path / "other_eval.tsv"
    other.write_text("\n".join([good] * 16) + "\n")
    again = run_multiprocess(_train, 2, common + [f"data.eval_paths={other}"], str(tmp_path / "run3"),
                             timeout_s=120)[0]["metrics"]
    assert again["eval"]["samples"] == 16 and again["steps_this_attempt"] == 3  # (the finished attempt's figures)
    assert json.loads((tmp_path / "run3" / "metrics.json").read_text())["eval"] == again["eval"]
    saved = tmp_path / "ckpt" / "metrics.json"
    saved.write_text(json.dumps(dict(json.loads(saved.read_text()), steps=2)))  # another attempt's figures
    with pytest.raises(RuntimeError, match=r"the run is already complete at step 3 \(checkpoint .*step_00000003\), "
                                           r"but its training figures for that step are not beside it \(those there "
                                           r"are of 2 steps, another attempt's"):
        run_multiprocess(_train, 2, common, str(tmp_path / "run4"), timeout_s=120)


def test_the_runs_end_is_saved_and_a_rerun_reports_it_without_training(tmp_path: Path) -> None:
    """``checkpoint.every_n_steps`` that does not divide the run's steps: the model at the end is saved too (it was
    saved nowhere, and re-running the finished run trained its tail again from the last periodic checkpoint,
    overwriting the finished run's figures). The save at the end changes no figure of the run."""
    common = ["data.num_train_batches=7", "data.num_eval_batches=2", "batch_size=64", "planner=herald",
              "planner.link_mbit=null", "pipeline=herald", "pipeline.window=2"]
    plain = run_multiprocess(_train, 2, common, str(tmp_path / "plain"))[0]
    ckpt = common + ["checkpoint.every_n_steps=3", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    first = run_multiprocess(_train, 2, ckpt, str(tmp_path / "run1"))[0]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        "step_00000006", "step_00000007"]  # (checkpoint.keep=2)
    assert first["losses"] == plain["losses"] and first["metrics"]["eval"] == plain["metrics"]["eval"]
    again = run_multiprocess(_train, 2, ckpt, str(tmp_path / "run2"))[0]
    assert again["metrics"]["steps_this_attempt"] == 7 and again["metrics"]["resumed_from_step"] is None
    assert again["metrics"] == first["metrics"] and again["losses"] == first["losses"]


@pytest.mark.parametrize("batches, every, before, damage", [(7, 3, 6, "missing"), (8, 4, 4, "missing"),
                                                             (8, 4, 4, "unreadable")])
def test_a_run_killed_between_its_final_save_and_its_figures_trains_its_tail_again(
        tmp_path: Path, batches: int, every: int, before: int, damage: str) -> None:
    """An attempt that ended after saving the run's end but before writing its figures beside it left a re-run
    that could only train everything again (``checkpoint.resume=false``). The re-run resumes from the checkpoint
    before the end and trains the tail again: the same losses and figures as the finished run. That holds where the
    run's end is a periodic save too (8 steps, every 4: it was not marked as the end, and the re-run was refused)."""
    common = [f"data.num_train_batches={batches}", "data.num_eval_batches=2", "batch_size=64",
              f"checkpoint.every_n_steps={every}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    first = run_multiprocess(_train, 2, common, str(tmp_path / "run1"))[0]
    for name in ("metrics.json", "losses.json"):  # (as an attempt killed right after the final save leaves it)
        (tmp_path / "ckpt" / name).unlink() if damage == "missing" else (tmp_path / "ckpt" / name).write_text("")
    again = run_multiprocess(_train, 2, common, str(tmp_path / "run2"))[0]
    assert again["metrics"]["resumed_from_step"] == before and again["metrics"]["steps_this_attempt"] == batches - before
    assert again["losses"] == first["losses"] and again["metrics"]["eval"] == first["metrics"]["eval"]
    assert json.loads((tmp_path / "ckpt" / "metrics.json").read_text())["steps"] == batches


def test_a_checkpoint_folder_whose_checkpoints_are_all_unusable_is_refused_before_training_and_kept(
        tmp_path: Path) -> None:
    """Its only checkpoint's trainer state truncated, a re-run trained from step 0 and its save of that step removed
    the user's checkpoint (whose weights were whole). Refused in one line; checkpoint.resume=false moves it aside."""
    ckpt = tmp_path / "ckpt"
    common = ["data.num_train_batches=4", "batch_size=16", "eval=false", "checkpoint.every_n_steps=2",
              "checkpoint.keep=1", f"checkpoint.dir={ckpt}"]
    run_multiprocess(_train, 1, common, str(tmp_path / "run1"), timeout_s=300)
    state = ckpt / "step_00000004" / "trainer_state.json"
    state.write_text(state.read_text()[:100])
    with pytest.raises(RuntimeError) as e:
        run_multiprocess(_train, 1, common, str(tmp_path / "run2"), timeout_s=300)
    assert (f"ValueError: checkpoint.dir {ckpt} holds 1 checkpoint(s) and none can be resumed (the newest, "
            f"step_00000004: trainer_state.json is truncated") in str(e.value), str(e.value)[-1500:]
    assert state.read_text() != "" and len(state.read_text()) == 100  # (kept as it was)
    run_multiprocess(_train, 1, common + ["checkpoint.resume=false"], str(tmp_path / "run3"), timeout_s=300)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.set-aside-")]
    assert len(aside) == 1 and len((aside[0] / "step_00000004" / "trainer_state.json").read_text()) == 100


def test_herald_pipeline_trains_every_epoch_and_reports_scheduler(tmp_path: Path) -> None:
    """pipeline=herald through the driver: every epoch is trained (the window restarts on each epoch's
    iterator), and metrics.json carries the scheduler's counters, consistent with TrafficMeter's tags."""
    res = run_multiprocess(_train, 2, ["data.num_train_batches=6", "data.num_eval_batches=2", "batch_size=64",
                                       "epochs=2", "planner=herald", "planner.link_mbit=null", "pipeline=herald",
                                       "pipeline.window=3"],
                           str(tmp_path))
    m = res[0]["metrics"]
    assert m["steps"] == 12
    hp = m["herald_pipeline"]
    assert hp["sync"] == "lazy" and hp["window"] == 3 and hp["allocator"] == "greedy"
    assert hp["reduce"] > 0 and 0.0 <= hp["hit_rate"] <= 1.0 and hp["scheduler_ms_per_step"] > 0
    # reduce messages carry one gradient (dim floats) each and travel only in the plan's reduce exchange
    assert m["traffic_per_step_by_tag"]["herald_reduce"]["embedding_vectors"] == pytest.approx(hp["reduce"])
    assert "herald_pooled" not in m["traffic_per_step_by_tag"]


def test_a_checkpoint_folder_in_use_by_a_running_run_is_refused(tmp_path: Path) -> None:
    """Two runs given one checkpoint folder at the same time would overwrite each other's checkpoints (or one
    would move them aside): the second stops on every rank, naming the folder and the process holding it."""
    import fcntl
    import os

    folder = tmp_path / "ckpt"
    overrides = ["data.num_train_batches=4", "data.num_eval_batches=1", "batch_size=32", "checkpoint.every_n_steps=2",
                 f"checkpoint.dir={folder}", "eval=false"]
    fd = os.open(tmp_path / ".ckpt.lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"pid 1234 on elsewhere since 2026-11-28 05:00:00")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a run training in that folder now)
    try:
        with pytest.raises(RuntimeError, match=(rf"ValueError: checkpoint folder {folder} is in use by another run "
                                                rf"\(pid 1234 on elsewhere since 2026-11-28 05:00:00\): give this run a "
                                                rf"folder of its own \(checkpoint.dir or run_name\), or re-run it once "
                                                rf"that one ends")):
            run_multiprocess(_train, 2, overrides, str(tmp_path / "run1"), timeout_s=120)
        assert not folder.exists()  # (nothing was written there)
        folder.mkdir()
        aliased = tmp_path / "ckpt_link"  # (the same folder by another path: the same lock)
        aliased.symlink_to(folder, target_is_directory=True)
        with pytest.raises(RuntimeError, match=rf"ValueError: checkpoint folder {aliased} is in use by another run"):
            run_multiprocess(_train, 2, overrides[:-2] + [f"checkpoint.dir={aliased}", "eval=false"],
                             str(tmp_path / "run1b"), timeout_s=120)
        # (a run that saves nothing but would move the folder aside, checkpoint.resume=false: refused too)
        unsaved = [o for o in overrides if not o.startswith("checkpoint.every_n_steps")] + ["checkpoint.resume=false"]
        with pytest.raises(RuntimeError, match=rf"ValueError: checkpoint folder {folder} is in use by another run"):
            run_multiprocess(_train, 2, unsaved, str(tmp_path / "run1c"), timeout_s=120)
        # (rank 0 alone decides whether to lock: a rank that does not see the folder, another host's disk, waits
        # for its outcome instead of training on; both hung)
        with pytest.raises(RuntimeError, match=rf"ValueError: checkpoint folder {folder} is in use by another run"):
            run_multiprocess(_train_folder_unseen_off_rank0, 2, unsaved, str(tmp_path / "run1d"), timeout_s=120)
        assert folder.is_dir() and not list(tmp_path.glob("ckpt.set-aside-*"))
    finally:
        os.close(fd)  # (that run ends)
    assert not any(folder.iterdir())
    m = run_multiprocess(_train, 2, overrides, str(tmp_path / "run2"), timeout_s=120)[0]["metrics"]
    assert m["steps"] == 4 and sorted(p.name for p in folder.glob("step_*")) == ["step_00000002", "step_00000004"]


def _train_in_own_folder(rank: int, world: int, overrides: List[str], folders: List[str], run_dir: str
                         ) -> Dict[str, Any]:
    """``_train`` with this rank's own ``checkpoint.dir`` (``folders[rank]``): ranks on hosts that each have a disk
    of their own at the folder's path. Its ValueError comes back as ``{"error": line}``."""
    try:
        return _train(rank, world, overrides + [f"checkpoint.dir={folders[rank]}"], run_dir)
    except ValueError as e:
        return {"error": str(e)}


def test_a_checkpoint_folder_the_ranks_do_not_share_is_refused_before_training(tmp_path: Path) -> None:
    """DCP's save has every rank write its shards into one folder. Ranks on hosts that each have a folder of that
    path (no shared file system) each saved a part of every checkpoint, without an error, and no resume could read
    one. A run that saves is refused on every rank before it trains, naming the ranks and their hosts; a run that
    resumes a checkpoint that a rank does not see is refused too, and the checkpoint is kept as it was."""
    import socket

    host = socket.gethostname()
    common = ["data.num_train_batches=4", "batch_size=16", "eval=false"]
    apart = [str(tmp_path / "host0" / "ckpt"), str(tmp_path / "host1" / "ckpt")]
    got = run_multiprocess(_train_in_own_folder, 2, common + ["checkpoint.every_n_steps=2"], apart,
                           str(tmp_path / "run1"), timeout_s=120)
    for rank, res in enumerate(got):
        assert re.fullmatch(
            rf"checkpoint folder {re.escape(apart[rank])} is not one folder every rank shares: rank 1 "
            rf"\(host {re.escape(host)}\) cannot see the file \.herald-write-check-shared-[0-9a-f]{{32}} that rank 0 "
            rf"\(host {re.escape(host)}\) sees there\. Every rank writes its shards of a checkpoint into that folder "
            rf"and reads them all at a resume: give checkpoint\.dir \(or checkpoint\.root\) a folder on a file "
            rf"system that every host mounts at the same path", res.get("error", "")), res
    assert list(Path(apart[0]).iterdir()) == [] and not Path(apart[1]).exists()  # (its file removed; nothing saved)
    assert not (tmp_path / "run1" / "losses.json").exists()  # (nothing trained)

    shared = [apart[0], apart[0]]  # (one folder: the check passes and leaves nothing behind)
    first = run_multiprocess(_train_in_own_folder, 2, common + ["checkpoint.every_n_steps=2"], shared,
                             str(tmp_path / "run2"), timeout_s=120)
    assert first[0]["metrics"]["steps"] == 4
    saved = sorted(p.name for p in Path(apart[0]).iterdir())
    assert saved == ["losses.json", "metrics.json", "step_00000002", "step_00000004"]

    resume_apart = [apart[0], str(tmp_path / "host1b" / "ckpt")]  # (resumes only: a rank without the checkpoint)
    got = run_multiprocess(_train_in_own_folder, 2, common, resume_apart, str(tmp_path / "run3"), timeout_s=120)
    for rank, res in enumerate(got):
        assert res.get("error") == (
            f"checkpoint folder {resume_apart[rank]} is not one folder every rank shares: rank 1 (host {host}) cannot "
            f"see the checkpoint step_00000004 that rank 0 (host {host}) sees there. Every rank writes its shards of "
            f"a checkpoint into that folder and reads them all at a resume: give checkpoint.dir (or checkpoint.root) "
            f"a folder on a file system that every host mounts at the same path"), res
    assert sorted(p.name for p in Path(apart[0]).iterdir()) == saved


def _train_folder_unseen_off_rank0(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    import pathlib

    if rank > 0:  # (this spawned rank's own module: the checkpoint folder is not on its disk)
        real = pathlib.Path.exists
        pathlib.Path.exists = lambda self, *a, **k: False if self.name == "ckpt" else real(self, *a, **k)  # type: ignore
    return _train(rank, world, overrides, run_dir)


def _train_without_locks(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    fcntl.flock = no_locks  # (this spawned rank's own module: a file system without locks)
    return _train(rank, world, overrides, run_dir)


def test_a_file_system_without_locks_trains_unguarded() -> None:
    """Where the checkpoint folder cannot be locked (a file system without flock), the run trains, with one
    warning, instead of calling the folder in use."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["data.num_train_batches=4", "data.num_eval_batches=1", "batch_size=32", "eval=false",
                     "checkpoint.every_n_steps=2", f"checkpoint.dir={tmp}/ckpt"]
        m = run_multiprocess(_train_without_locks, 2, overrides, f"{tmp}/run", timeout_s=120)[0]["metrics"]
        assert m["steps"] == 4
        assert _warned(f"{tmp}/run", f"checkpoint folder {tmp}/ckpt cannot be locked (No locks available): nothing "
                                     f"stops another run from using it at the same time") == [1, 0]


def _warned(run_dir: str, line: str) -> List[int]:
    """How many times each rank's log in ``run_dir`` says ``line``."""
    return [(Path(run_dir) / "logs" / f"rank{r}.log").read_text().count(line) for r in range(2)]


def _train_lock_unwritable(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    import errno
    import os

    real = os.open

    def refused(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    os.open = refused  # (this spawned rank's own module: the folder's parent is not writable, e.g. a mount point)
    return _train(rank, world, overrides, run_dir)


def test_a_checkpoint_folder_whose_lock_cannot_be_made_trains_unguarded() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["data.num_train_batches=4", "data.num_eval_batches=1", "batch_size=32", "eval=false",
                     "checkpoint.every_n_steps=2", f"checkpoint.dir={tmp}/ckpt"]
        m = run_multiprocess(_train_lock_unwritable, 2, overrides, f"{tmp}/run", timeout_s=120)[0]["metrics"]
        assert m["steps"] == 4
        lock = Path(f"{tmp}/ckpt").resolve().parent / ".ckpt.lock"
        assert _warned(f"{tmp}/run", f"checkpoint folder {tmp}/ckpt cannot be locked ({lock} cannot be made: "
                                     f"Permission denied): nothing stops another run from using it at the same "
                                     f"time") == [1, 0]


def test_a_finished_runs_unreadable_figures_are_named_and_written_whole(tmp_path: Path) -> None:
    """A full disk at a run's end left an empty metrics.json beside its checkpoints, and the re-run failed with a
    bare JSONDecodeError naming no file (a truncated losses.json was copied on silently). The files are written
    whole or not at all; one that cannot be read is named with the two ways on."""
    from torchrec_herald.trainer import copy_whole

    ckpt = tmp_path / "ckpt"
    run = ["data.num_train_batches=4", "batch_size=16", "eval=false", f"checkpoint.dir={ckpt}",
           "checkpoint.every_n_steps=2", "checkpoint.keep=1"]  # (no checkpoint before the end: its tail cannot be
    run_multiprocess(_train, 1, run, str(tmp_path / "first"), timeout_s=300)  # trained again from one)
    for name, content in (("metrics.json", ""), ("losses.json", "[0.69, 0.6")):
        good = (ckpt / name).read_text()
        (ckpt / name).write_text(content)
        with pytest.raises(RuntimeError) as e:
            run_multiprocess(_train, 1, run, str(tmp_path / f"again_{name}"), timeout_s=300)
        assert (f"ValueError: {ckpt / name}, the finished run's figures beside its checkpoints, cannot be read "
                f"(JSONDecodeError: ") in str(e.value), str(e.value)[-2000:]
        assert ("restore it (the run folder of the attempt that finished holds a copy), or checkpoint.resume=false "
                "to train the run again") in str(e.value)
        (ckpt / name).write_text(good)
    # a copy that fails once its data is written (the disk full at the rename) leaves the earlier file whole, and
    # no temporary one
    import os

    (tmp_path / "copy.json").write_text("earlier")

    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    real = os.replace
    os.replace = full
    try:
        with pytest.raises(OSError):
            copy_whole(tmp_path / "first" / "metrics.json", tmp_path / "copy.json")
    finally:
        os.replace = real
    assert (tmp_path / "copy.json").read_text() == "earlier"
    assert not (tmp_path / ".copy.json.tmp").exists()
    copy_whole(tmp_path / "first" / "metrics.json", tmp_path / "copy.json")
    assert (tmp_path / "copy.json").read_text() == (tmp_path / "first" / "metrics.json").read_text()


def test_a_resume_past_the_data_or_the_epochs_names_what_changed(tmp_path: Path) -> None:
    """A checkpoint without its run's figures (the attempt ended after its last save) met by a re-run whose data
    is now shorter than the checkpoint's position, or whose ``epochs`` ends before it, was reported as "already
    complete": the line names the data (and its key) or ``epochs`` instead."""
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    train = tmp_path / "train.tsv"
    train.write_text("\n".join([good] * 40) + "\n")  # 10 global batches of 1 × 4, every 10th held out: 9 trained
    ckpt = tmp_path / "ckpt"
    run = ["data=criteo_tsv", f"data.paths={train}", "batch_size=4", "eval=false", f"checkpoint.dir={ckpt}",
           "checkpoint.every_n_steps=4", "epochs=2"]
    assert run_multiprocess(_train, 1, run, str(tmp_path / "first"), timeout_s=300)[0]["metrics"]["steps"] == 18
    # with the figures there it reported the 2-epoch run as the 1-epoch command's; without them (an attempt killed
    # after its final save) the re-run resumes the checkpoint before the end, step 16, which is past epochs=1 too
    for figures, step in (("there", 18), ("gone", 16)):
        if figures == "gone":
            for name in ("metrics.json", "losses.json"):
                (ckpt / name).unlink()
        with pytest.raises(RuntimeError) as e:
            run_multiprocess(_train, 1, run[:-1] + ["epochs=1"], str(tmp_path / f"fewer_epochs_{figures}"),
                             timeout_s=300)
        assert (f"ValueError: epochs=1 ends before the checkpoint {ckpt}/step_{step:08d} (step {step}, in epoch 2): "
                f"give epochs >= 2 to train the run on (or report it), or checkpoint.resume=false to train it again"
                ) in str(e.value)
    train.write_text("\n".join([good] * 20) + "\n")  # now 5 global batches of 1 × 4, all trained
    with pytest.raises(RuntimeError) as e:
        run_multiprocess(_train, 1, run, str(tmp_path / "shorter"), timeout_s=300)
    assert (f"ValueError: CriteoTSV(train.tsv) now holds 5 global batch(es) of 1 × 4 samples, fewer than the "
            f"checkpoint {ckpt}/step_00000016 trained of it (7 in epoch 2): the data changed since (data.paths); give "
            f"the run's data, or checkpoint.resume=false to train it again") in str(e.value), str(e.value)[-1500:]


def _tsv_rows(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return "".join("\t".join([str(rng.randint(0, 1))] + [str(rng.randint(0, 50)) for _ in range(13)]
                             + [format(rng.randint(0, 40), "x") for _ in range(26)]) + "\n" for _ in range(n))


def test_an_eval_split_ending_in_a_short_global_batch_is_scored_whole(tmp_path: Path) -> None:
    """The eval split's last, incomplete global batch was dropped (5 of 37 rows unscored, said at INFO only); it is
    now padded, the padding left out of AUC and logloss."""
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train.write_text(_tsv_rows(24, 0))
    evals.write_text(_tsv_rows(37, 1))
    m = run_multiprocess(_train, 2, ["data=criteo_tsv", f"data.paths={train}", f"data.eval_paths={evals}",
                                     "batch_size=4"], str(tmp_path / "run"), timeout_s=120)[0]["metrics"]
    assert m["eval"]["samples"] == 37 and m["data_stats"]["eval_dropped_tail_samples"] == 0
    evals.write_text(_tsv_rows(3, 1))  # rank 1's slice all padding: it scores nothing, and the gather still runs
    m = run_multiprocess(_train, 2, ["data=criteo_tsv", f"data.paths={train}", f"data.eval_paths={evals}",
                                     "batch_size=4"], str(tmp_path / "run3"), timeout_s=120)[0]["metrics"]
    assert m["eval"]["samples"] == 3


def test_checkpoints_of_a_herald_window_read_a_file_once_and_change_no_loss(tmp_path: Path) -> None:
    """At every checkpoint a herald pipeline starts its window again at the data's position: the stream was opened
    again and parsed the file from the pass's start each time (quadratic in the run's length). The batches read
    ahead are now kept and given again."""
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    train.write_text(_tsv_rows(120, 2))
    evals.write_text(_tsv_rows(8, 3))
    common = ["data=criteo_tsv", f"data.paths={train}", f"data.eval_paths={evals}", "batch_size=4", "planner=herald",
              "planner.link_mbit=null", "pipeline=herald", "pipeline.scheduling=on", "pipeline.window=3"]
    plain = run_multiprocess(_train, 2, common, str(tmp_path / "plain"), timeout_s=180)[0]
    saved = run_multiprocess(_train, 2, common + ["checkpoint.every_n_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}"],
                             str(tmp_path / "saved"), timeout_s=180)[0]
    assert saved["metrics"]["steps"] == 15 and saved["losses"] == plain["losses"]
    reads = [(tmp_path / run / "logs" / "rank0.log").read_text().count(f"reading Criteo TSV {train}")
             for run in ("plain", "saved")]
    # preflight's check of the first record and its count of the first batches, the planner's count of row accesses,
    # then training (7 checkpoints: 11 reads before; preflight's two were not in the log file then)
    assert reads == [4, 4]


def test_a_runs_figures_are_written_whole_and_a_failed_write_names_the_file(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk at the run's end left losses.json at 0 bytes and a line naming no file."""
    import errno
    import os

    from torchrec_herald.trainer import write_whole

    target = tmp_path / "losses.json"
    write_whole(target, "[0.5]")
    assert target.read_text() == "[0.5]"

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as e:
        write_whole(target, "[0.5, 0.4]")
    assert str(e.value) == (f"[Errno 28] cannot write {target} (No space left on device): the run's figures go to its "
                            f"folder (hydra.run.dir); make room there or give another")
    assert target.read_text() == "[0.5]" and sorted(p.name for p in tmp_path.iterdir()) == ["losses.json"]


@pytest.mark.parametrize("overrides,folder,label", [
    (["planner=table_wise"], "run", "train stock_table_wise"), (["planner=stock"], "run", "train stock_default"),
    (["planner=herald"], "run", "train herald"), (["planner=table_wise"], "baseline_table_wise", "train table_wise (baseline)"),
    (["planner=herald", "pipeline=herald"], "exact_reference", "train exact reference")])
def test_the_progress_bar_names_the_planner_as_the_run_folder_does(overrides: List[str], folder: str, label: str) -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.run_identity import run_name
    from torchrec_herald.trainer import Trainer

    cfg = compose_config(overrides)
    assert Trainer(cfg, Path("/nonexistent") / folder)._progress_label() == label
    if folder == "run":
        assert run_name(cfg, 2).startswith(label.removeprefix("train ") + "-")
