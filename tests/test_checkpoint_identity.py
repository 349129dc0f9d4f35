"""A checkpoint records the run that saved it; a run never resumes another run's checkpoints (it would
train that run on under other settings, at a data position of another batch size, and prune its
checkpoints), and a checkpoint that cannot be used is named with what is wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from torchrec_herald.checkpoint import TRAINER_STATE, latest_checkpoint, load_checkpoint, save_checkpoint
from torchrec_herald.config import compose_config
from torchrec_herald.run_identity import (check_checkpoint_location, checkpoint_dir, companion_run, resume_problem,
                                          run_name, training_identity)
from torchrec_herald.trainer import TRAINER_KEYS, exact_reference_config

from herald_harness import preflight_error  # tests/

BASE = ["data.num_train_batches=8", "batch_size=16"]


def _saved_run(folder: Path, overrides: List[str], world_size: int = 1, step: int = 4,
               state: Dict[str, Any] | None = None) -> Path:
    """A checkpoint at ``folder/step_<step>`` as the trainer leaves it, saved by the run ``overrides`` (a tiny
    stand-in model: what is compared is its trainer_state.json)."""
    model = torch.nn.Linear(2, 1)
    run = training_identity(compose_config(overrides), world_size)
    trainer = {"epoch": 0, "batch_in_epoch": step, "losses_by_rank": [[0.5] * step] * world_size, "rng": {},
               "pipeline": None, "run": run} if state is None else state
    return save_checkpoint(folder, step, model, torch.optim.SGD(model.parameters(), lr=0.1), trainer)




def test_a_run_refuses_another_runs_checkpoint_in_its_folder_naming_what_differs(tmp_path: Path) -> None:
    where = [f"checkpoint.dir={tmp_path}", "checkpoint.every_n_steps=2"]
    path = _saved_run(tmp_path, BASE + where)
    assert preflight_error(BASE + where) == "no error"  # the same run: it resumes
    assert preflight_error(BASE + where + ["epochs=3"]) == "no error"  # more epochs train the same run on
    assert preflight_error(BASE + where + ["optimizer.lr=0.5", "batch_size=32"]) == (
        f"ValueError: checkpoint {path} was saved by another run (batch_size=32 here, 16 there; optimizer.lr=0.5 "
        f"here, 0.05 there): resuming it would train that run on with these settings. Give this run a folder of "
        f"its own (checkpoint.dir or run_name), or checkpoint.resume=false to start fresh (the checkpoints there "
        f"are moved aside, not deleted)")
    assert preflight_error(BASE + where + ["optimizer.lr=0.5", "checkpoint.resume=false"]) == "no error"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000004"]  # nothing was moved or pruned by a check


def test_a_run_on_other_ranks_refuses_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = BASE + [f"checkpoint.dir={tmp_path}"]
    path = _saved_run(tmp_path, where, world_size=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert preflight_error(where).startswith(
        f"ValueError: checkpoint {path} was saved by another run (2 rank(s) here, 1 there): ")


def test_a_checkpoint_without_a_recorded_run_resumes_with_a_warning(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from torchrec_herald.trainer import Checkpointing

    state = {"epoch": 0, "batch_in_epoch": 4, "losses_by_rank": [[0.5] * 4], "rng": {}, "pipeline": None}
    path = _saved_run(tmp_path, BASE, state=state)
    overrides = BASE + [f"checkpoint.dir={tmp_path}", "optimizer.lr=0.5"]
    assert resume_problem(None, training_identity(compose_config(overrides), 1), path) is None
    assert preflight_error(overrides) == "no error"
    with caplog.at_level(logging.WARNING):
        assert Checkpointing(compose_config(overrides), None, None, None, 1).problem(path) is None
    assert (f"checkpoint {path} does not record the run that saved it (an older version's): resuming it without "
            f"comparing its settings with this run's") in caplog.text


def test_the_eval_split_may_change_on_resume_what_is_trained_may_not(tmp_path: Path) -> None:
    where = BASE + [f"checkpoint.dir={tmp_path}"]
    path = _saved_run(tmp_path, where)
    assert preflight_error(where + ["data.num_eval_batches=3"]) == "no error"
    assert preflight_error(where + ["data.num_train_batches=9"]).startswith(
        f"ValueError: checkpoint {path} was saved by another run (data.num_train_batches=9 here, 8 there): ")


def test_the_derived_run_name_stays_when_only_what_a_resume_may_change_changes() -> None:
    """Re-running the same command with more epochs or another eval split finds the run's checkpoints (the
    derived folder must not move with those keys); what is trained still names another run."""
    name = run_name(compose_config(BASE), 1)
    for same in (["epochs=3"], ["data.num_eval_batches=3"], ["log_every=7"]):
        assert run_name(compose_config(BASE + same), 1) == name, same
        assert checkpoint_dir(compose_config(BASE + same), 1) == checkpoint_dir(compose_config(BASE), 1)
    for other in (["optimizer.lr=0.5"], ["data.num_train_batches=9"], ["batch_size=32"]):
        assert run_name(compose_config(BASE + other), 1) != name, other
    assert run_name(compose_config(BASE), 2) != name
    tsv = ["data=criteo_tsv", "data.paths=[/t.tsv]"]
    assert run_name(compose_config(tsv + ["data.eval_paths=[/e.tsv]"]), 1) == run_name(compose_config(tsv), 1)


def test_more_than_six_differences_are_counted() -> None:
    mine = {"world_size": 1, "config": {f"k{i}": i for i in range(9)}}
    theirs = {"world_size": 1, "config": {f"k{i}": i + 1 for i in range(9)}}
    got = resume_problem(theirs, mine, Path("/c"))
    assert got is not None and got.startswith("checkpoint /c was saved by another run (k0=0 here, 1 there; ") and \
        "k5=5 here, 6 there; and 3 more)" in got


def test_a_baseline_and_an_exact_reference_checkpoint_beside_the_run_not_into_its_folder(tmp_path: Path) -> None:
    """Beside, not inside: ``checkpoint.resume=false`` moves the run's folder aside, which must not take the
    baseline's finished checkpoints with it."""
    cfg = compose_config(BASE + [f"checkpoint.dir={tmp_path}/run", "run_name=mine"])
    companion_run(cfg, "baseline_table_wise")
    assert (cfg.checkpoint.dir, cfg.run_name) == (f"{tmp_path}/run-baseline_table_wise", "mine-baseline_table_wise")
    approx = compose_config(BASE + ["planner=herald", "pipeline=herald", "pipeline.staleness=1", "run_name=het"])
    ref = exact_reference_config(approx)
    assert ref.run_name == "het-exact_reference" and ref.checkpoint.dir is None and ref.pipeline.staleness is None


def test_a_checkpoint_folder_given_as_one_checkpoint_is_named(tmp_path: Path) -> None:
    path = _saved_run(tmp_path, BASE)
    with pytest.raises(ValueError, match=rf"^checkpoint.dir={path} is one checkpoint \(step_00000004\); give the "
                                         rf"folder that holds the run's checkpoints: {tmp_path}$"):
        check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={path}"]), 1, writing=True)


def test_a_checkpoint_folder_holding_a_users_files_is_refused_before_training_naming_them(tmp_path: Path) -> None:
    """A run saves into its checkpoint folder, overwrites metrics.json and losses.json there at its end, and with
    ``checkpoint.resume=false`` moves the folder aside: a user's own files there (or another run's folder under a
    ``checkpoint.root``, or a Hydra run folder) are refused, naming them, where a run would save or move them. What
    a run leaves there itself is accepted, and a folder only read (resuming, saving nothing), or not moved (no
    checkpoint to move aside), is not checked."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.json").write_text('{"my": "analysis"}')
    (mine / "notes.txt").write_text("mine")
    tail = ("a run saves there, writes metrics.json and losses.json at its end and, with checkpoint.resume=false, "
            "moves the folder aside. Give the checkpoints a folder of their own (new or empty)")
    for extra in (["checkpoint.every_n_steps=2"], ["checkpoint.resume=false"]):
        where = compose_config(BASE + [f"checkpoint.dir={mine}"] + extra)
        if extra == ["checkpoint.resume=false"]:  # (nothing to move aside: not checked)
            assert check_checkpoint_location(where, 1, writing=False) == mine
            _saved_run(mine, BASE)
        with pytest.raises(ValueError) as e:
            check_checkpoint_location(where, 1, writing=bool(extra[0].startswith("checkpoint.every")))
        named = "metrics.json, notes.txt" if extra != ["checkpoint.resume=false"] else "notes.txt"  # (beside steps)
        assert str(e.value) == f"checkpoint.dir={mine} holds files that are not this trainer's checkpoints ({named}): " + tail
    assert check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={mine}"]), 1, writing=False) == mine
    # a run's own folder: checkpoints, a finished run's figures beside them, a save in progress
    ours = tmp_path / "ours"
    _saved_run(ours, BASE)
    (ours / "metrics.json").write_text("{}")
    (ours / "losses.json").write_text("[]")
    (ours / ".tmp-step_00000006").mkdir()
    assert check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={ours}", "checkpoint.every_n_steps=2"]),
                                     1, writing=True) == ours
    # a checkpoint.root, given as another run's checkpoint.dir; a Hydra run folder
    root = tmp_path / "root"
    _saved_run(root / "run_a", BASE)
    hydra = tmp_path / "outputs"
    (hydra / ".hydra").mkdir(parents=True)
    (hydra / "logs").mkdir()
    for folder, named, why in ((root, "run_a", ""), (hydra, ".hydra, logs", " (it is a Hydra run folder: hydra.run.dir, "
                                                                           "where the run writes its logs and metrics)")):
        with pytest.raises(ValueError) as e:
            check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={folder}", "checkpoint.every_n_steps=2"]),
                                      1, writing=True)
        assert str(e.value) == f"checkpoint.dir={folder} holds files that are not this trainer's checkpoints ({named}){why}: " + tail


def test_the_current_folder_as_checkpoint_folder_is_refused_naming_the_key(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint.dir=.`` would save into the current folder and, with ``checkpoint.resume=false``, fail to move it
    aside (``PosixPath('.') has an empty name``, after training had begun): refused before, naming the key."""
    monkeypatch.chdir(tmp_path)
    for given in (".", ".."):
        with pytest.raises(ValueError) as e:
            check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={given}"]), 1, writing=False)
        assert str(e.value) == (f"checkpoint.dir={given} is not a folder of its own (the run would save into, and with "
                                f"checkpoint.resume=false move aside, {Path(given).resolve()}); give a named folder, "
                                f"e.g. checkpoint.dir=checkpoints/<name>")


def test_a_trainer_state_missing_a_key_is_skipped_for_an_older_checkpoint(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    older = _saved_run(tmp_path, BASE, step=2)
    newer = _saved_run(tmp_path, BASE, step=4)
    state = json.loads((newer / TRAINER_STATE).read_text())
    del state["rng"]
    (newer / TRAINER_STATE).write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path, TRAINER_KEYS) == older
        assert latest_checkpoint(tmp_path) == newer  # (the library's own saves need a step only)
    assert f"skipping checkpoint {newer}: {TRAINER_STATE} has no rng; using an older one" in caplog.text


def test_a_truncated_shard_is_named_with_its_checkpoint(tmp_path: Path) -> None:
    path = _saved_run(tmp_path, BASE)
    (shard,) = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=rf"^checkpoint {path} cannot be read \(rank 0: EOFError\); remove that "
                                         rf"folder to resume from an older checkpoint, or checkpoint.resume=false "
                                         rf"to start fresh$"):
        load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_giving_or_dropping_eval_files_on_resume_is_refused_as_it_moves_the_training_batches(tmp_path: Path) -> None:
    """The eval split's keys may change on resume, but a file source without ``data.eval_paths`` holds every
    ``holdout_every``-th training batch out: giving eval files at a resume trained a batch twice and another never
    (the saved position then points into another stream). Refused naming the key; other eval files may still be
    given."""
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    train, evals, other = tmp_path / "train.tsv", tmp_path / "eval.tsv", tmp_path / "other.tsv"
    for f in (train, evals, other):
        f.write_text("\n".join([good] * 64) + "\n")
    ckpt = tmp_path / "ckpt"
    where = ["data=criteo_tsv", f"data.paths={train}", "batch_size=4", f"checkpoint.dir={ckpt}",
             "checkpoint.every_n_steps=2"]
    path = _saved_run(ckpt, where)
    assert preflight_error(where + [f"data.eval_paths={evals}"]) == (
        f"ValueError: checkpoint {path} was saved by another run (data.eval_paths given here, empty there (without "
        f"eval files every data.holdout_every-th training batch is held out, so the trained batches differ)): "
        f"resuming it would train that run on with these settings. Give this run a folder of its own (checkpoint.dir "
        f"or run_name), or checkpoint.resume=false to start fresh (the checkpoints there are moved aside, not "
        f"deleted)")
    with_eval = tmp_path / "ckpt_eval"
    _saved_run(with_eval, where[:-2] + [f"checkpoint.dir={with_eval}", "checkpoint.every_n_steps=2",
                                        f"data.eval_paths={evals}"])
    assert preflight_error(where[:-2] + [f"checkpoint.dir={with_eval}", "checkpoint.every_n_steps=2",
                                         f"data.eval_paths={other}"]) == "no error"
    assert preflight_error(where[:-2] + [f"checkpoint.dir={with_eval}", "checkpoint.every_n_steps=2"]).startswith(
        f"ValueError: checkpoint {with_eval}/step_00000004 was saved by another run (data.eval_paths empty here, "
        f"given there (")


def test_a_changed_group_option_leads_the_list_of_what_differs(tmp_path: Path) -> None:
    """A resume refused for another planner listed the option's keys alphabetically and cut the list after six,
    leaving out ``planner.name``, the key the user changed: it leads now."""
    where = BASE + [f"checkpoint.dir={tmp_path}", "checkpoint.every_n_steps=2"]
    path = _saved_run(tmp_path, where)
    assert preflight_error(where + ["planner=herald"]).startswith(
        f"ValueError: checkpoint {path} was saved by another run (planner.name=herald here, stock there; ")


def test_a_file_named_as_a_checkpoint_is_not_taken_for_one(tmp_path: Path) -> None:
    """A file named ``step_00000008`` in the checkpoint folder passed the folder check as a checkpoint; the run then
    trained and failed at that save ("Not a directory"). It is named before training as a file that is not this
    trainer's."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "step_00000008").write_text("not a checkpoint")
    with pytest.raises(ValueError) as e:
        check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={folder}", "checkpoint.every_n_steps=2"]),
                                  1, writing=True)
    assert str(e.value).startswith(f"checkpoint.dir={folder} holds files that are not this trainer's checkpoints "
                                   f"(step_00000008): ")


def test_resume_false_on_a_folder_that_cannot_be_moved_is_refused_naming_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint.resume=false`` renames the folder holding checkpoints in its parent: on a read-only parent it
    failed after the model was built with a bare ``OSError: [Errno 30] Read-only file system``. Refused first."""
    import errno
    import tempfile

    folder = tmp_path / "ro" / "ckpt"
    _saved_run(folder, BASE)
    real = tempfile.mkstemp

    def read_only(*args: Any, dir: Any = None, **kwargs: Any) -> Any:
        if Path(dir) == folder.parent:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    where = compose_config(BASE + [f"checkpoint.dir={folder}", "checkpoint.resume=false"])
    with pytest.raises(ValueError) as e:
        check_checkpoint_location(where, 1, writing=False)
    assert str(e.value) == (f"checkpoint.resume=false would move {folder}'s checkpoints aside, but its parent "
                            f"{folder.parent} is not writable (Read-only file system); give checkpoint.dir a writable "
                            f"folder, or resume (checkpoint.resume=true)")
    assert check_checkpoint_location(compose_config(BASE + [f"checkpoint.dir={folder}"]), 1, writing=False) == folder


def test_eval_files_given_at_a_resume_are_refused_from_the_recorded_paths_and_only_between_file_sources(
        tmp_path: Path) -> None:
    """Whether eval files are given is read from the ``data.eval_paths`` every checkpoint records (those saved before
    this check too: it resumed silently), not from a key of its own. A synthetic run meeting a file run's checkpoint
    says that its data differs, not "data.eval_paths empty here, empty there"."""
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    for f in (train, evals):
        f.write_text("\n".join([good] * 64) + "\n")
    ckpt = tmp_path / "ckpt"
    where = ["data=criteo_tsv", f"data.paths={train}", "batch_size=4", f"checkpoint.dir={ckpt}",
             "checkpoint.every_n_steps=2"]
    path = _saved_run(ckpt, where)
    assert "data.eval_paths" in json.loads((path / TRAINER_STATE).read_text())["run"]["config"]
    assert preflight_error(where + [f"data.eval_paths={evals}"]).startswith(
        f"ValueError: checkpoint {path} was saved by another run (data.eval_paths given here, empty there (without "
        f"eval files every data.holdout_every-th training batch is held out, so the trained batches differ)): ")
    assert preflight_error(where) == "no error"
    synthetic = preflight_error(["batch_size=4", f"checkpoint.dir={ckpt}", "checkpoint.every_n_steps=2"])
    assert synthetic.startswith(f"ValueError: checkpoint {path} was saved by another run (data.name=synthetic here, "
                                f"criteo_tsv there; "), synthetic
    assert "data.eval_paths" not in synthetic, synthetic
