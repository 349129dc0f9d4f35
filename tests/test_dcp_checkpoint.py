"""Checkpoints through ``torch.distributed.checkpoint`` (torchrec_herald/checkpoint.py), 2 ranks:
a herald checkpoint loads into stock ROW_WISE and TABLE_WISE DMPs, into an EBC mixing herald and stock
TABLE_WISE tables, and back with identical weights and row-wise Adagrad state (DCP reshards; no rank gathers a table); a checkpoint of other shapes is refused
naming the table and both shapes; interrupted saves are skipped with a warning naming them."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from torchrec_herald.dist_utils import run_multiprocess

CFG = dict(optimizer="rowwise_adagrad", via="apply", steps=4, sync="dense")


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    from herald_harness import build, full_momentum, full_state, hot_replica_gap, run_steps
    from torchrec_herald.pipeline.context import find_herald_ebc
    from torchrec_herald.checkpoint import load_checkpoint, save_checkpoint

    out: Dict[str, Any] = {}
    h = build(world, dict(CFG, planner="herald"))
    run_steps(h["dmp"], h["optimizer"], h["data"].train_batches(rank, world, h["batch_size"]))
    ref_w, ref_m = full_state(h["dmp"]), full_momentum(h["dmp"])
    path = save_checkpoint(Path(root) / "h", 4, h["dmp"], h["optimizer"], {"note": "herald"})
    targets = {"row_wise": dict(CFG, planner="row_wise"), "table_wise": dict(CFG, planner="table_wise"),
               "herald": dict(CFG, planner="herald", hot_min_count=3),
               "mixed": dict(CFG, planner="herald", stock_tables=("table_wise", 2))}  # herald + stock in one EBC
    for target, cfg in targets.items():
        t = build(world, cfg)
        state = load_checkpoint(path, t["dmp"], t["optimizer"])
        out[f"{target}_state"] = state
        w, m = full_state(t["dmp"]), full_momentum(t["dmp"])
        out[f"{target}_w"] = all(torch.equal(w[k], ref_w[k]) for k in ref_w)
        out[f"{target}_m"] = sorted(m) == sorted(ref_m) and all(torch.equal(m[k], ref_m[k]) for k in ref_m)
        if target in ("herald", "mixed"):  # each rank's hot replicas hold the loaded rows
            out[f"{target}_hot_gap"] = hot_replica_gap(find_herald_ebc(t["dmp"]), ref_w)
    # a mixed EBC's own checkpoint (the EBC's keys) loads into stock TABLE_WISE
    mixed = build(world, targets["mixed"])
    run_steps(mixed["dmp"], mixed["optimizer"], mixed["data"].train_batches(rank, world, mixed["batch_size"]))
    mixed_path = save_checkpoint(Path(root) / "mixed", 4, mixed["dmp"], mixed["optimizer"], {})
    into = build(world, targets["table_wise"])
    load_checkpoint(mixed_path, into["dmp"], into["optimizer"])
    mw, mm, iw, im = full_state(mixed["dmp"]), full_momentum(mixed["dmp"]), full_state(into["dmp"]), full_momentum(into["dmp"])
    out["mixed_to_tw"] = (all(torch.equal(iw[k], mw[k]) for k in mw) and sorted(im) == sorted(mm)
                          and all(torch.equal(im[k], mm[k]) for k in mm))
    # and back: stock TABLE_WISE trained -> DCP -> herald
    tw = build(world, dict(CFG, planner="table_wise"))
    run_steps(tw["dmp"], tw["optimizer"], tw["data"].train_batches(rank, world, tw["batch_size"]))
    tw_path = save_checkpoint(Path(root) / "tw", 4, tw["dmp"], tw["optimizer"], {})
    h2 = build(world, dict(CFG, planner="herald"))
    load_checkpoint(tw_path, h2["dmp"], h2["optimizer"])
    w, m, tw_w, tw_m = full_state(h2["dmp"]), full_momentum(h2["dmp"]), full_state(tw["dmp"]), full_momentum(tw["dmp"])
    out["back_w"] = all(torch.equal(w[k], tw_w[k]) for k in tw_w)
    out["back_m"] = all(torch.equal(m[k], tw_m[k]) for k in tw_m)
    # hot replicas hold the loaded rows on every rank (they were refreshed from the blocks' owners)
    out["back_hot_gap"] = hot_replica_gap(find_herald_ebc(h2["dmp"]), tw_w)
    # a model of other table sizes is refused, naming the table and both shapes
    from herald_harness import make_data

    small = make_data({"steps": 4})
    small.num_embeddings = [n + 1 for n in small.num_embeddings]
    other = build(world, dict(CFG, planner="herald"), data=small)
    try:
        load_checkpoint(path, other["dmp"], other["optimizer"])
        out["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = f"{type(e).__name__}: {e}"
    out["path"] = str(path)
    # keep=1: a newer save removes the older ones
    h_keep = build(world, dict(CFG, planner="herald"))
    for step in (2, 3):
        save_checkpoint(Path(root) / "keep", step, h_keep["dmp"], h_keep["optimizer"], {}, keep=1)
    out["kept"] = sorted(p.name for p in (Path(root) / "keep").iterdir())
    return out


@functools.lru_cache(maxsize=None)
def _results(root: str) -> tuple:
    return tuple(run_multiprocess(_worker, 2, root, timeout_s=300))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return _results(str(tmp_path_factory.mktemp("dcp")))


def test_herald_checkpoint_loads_into_stock_row_wise_table_wise_herald_and_mixed(results: tuple) -> None:
    for r in results:
        for target in ("row_wise", "table_wise", "herald", "mixed"):
            assert r[f"{target}_state"]["note"] == "herald" and r[f"{target}_state"]["step"] == 4
            assert r[f"{target}_w"], target
            assert r[f"{target}_m"], target
        assert r["herald_hot_gap"] == 0.0 and r["mixed_hot_gap"] == 0.0


def test_a_mixed_ebc_checkpoint_loads_into_stock_table_wise(results: tuple) -> None:
    for r in results:
        assert r["mixed_to_tw"]


def test_stock_table_wise_checkpoint_loads_into_herald(results: tuple) -> None:
    for r in results:
        assert r["back_w"] and r["back_m"]
        assert r["back_hot_gap"] == 0.0  # each rank's replicas: the loaded rows


def test_checkpoint_of_other_shapes_is_refused_naming_the_table(results: tuple) -> None:
    msg = results[0]["mismatch"]
    assert msg.startswith("CheckpointMismatchError: table 't_cat_0': the checkpoint "), msg
    assert "holds shape (" in msg and "the model (" in msg


def test_only_the_newest_keep_checkpoints_remain(results: tuple) -> None:
    assert results[0]["kept"] == ["step_00000003"]


def test_interrupted_saves_are_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from torchrec_herald.checkpoint import latest_checkpoint

    def fake(name: str, metadata: bool, state: str = None) -> Path:
        p = tmp_path / name
        p.mkdir()
        if metadata:
            (p / ".metadata").write_bytes(b"")
        if state is not None:
            (p / "trainer_state.json").write_text(state)
        return p

    fake(".tmp-step_00000030", metadata=False)  # killed during dcp.save
    fake("step_00000020", metadata=True, state='{"step": 2')  # truncated trainer state
    fake("step_00000025", metadata=False, state='{"step": 25}')  # DCP never finished
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.checkpoint"):
        assert latest_checkpoint(tmp_path) is None  # none usable here (empty .metadata is unreadable too)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(".tmp-step_00000030: a save that did not finish" in m for m in msgs), msgs
    assert any("step_00000025: no .metadata" in m for m in msgs), msgs
    assert any("step_00000020: trainer_state.json is truncated" in m for m in msgs), msgs
    # the checks before training and the resume each look: each folder is said once a process (it was three times)
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.checkpoint"):
        assert latest_checkpoint(tmp_path) is None
    assert [r.getMessage() for r in caplog.records] == msgs


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(results: tuple) -> None:
    from torchrec_herald.checkpoint import latest_checkpoint

    good = Path(results[0]["path"])
    root = good.parent
    (root / ".tmp-step_00000008").mkdir(exist_ok=True)  # the next save, killed before its rename
    (root / ".tmp-step_00000008" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(root) == good
    assert json.loads((good / "trainer_state.json").read_text())["step"] == 4


def _save_failing_on_rank0(rank: int, world: int, root: str) -> str:
    import os as _os

    from torchrec_herald import checkpoint

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        def full(src: str, dst: str) -> None:
            raise OSError(28, "No space left on device", dst)

        _os.replace = full  # (this spawned rank's own os module)
    try:
        checkpoint.save_checkpoint(Path(root), 1, model, opt, {"epoch": 0})
    except OSError as e:
        return str(e)
    return "saved"


def test_a_save_failing_on_rank_0_raises_its_line_on_every_rank(tmp_path: Path) -> None:
    got = run_multiprocess(_save_failing_on_rank0, 2, str(tmp_path))
    line = f"cannot finish the checkpoint {tmp_path}/step_00000001: No space left on device ({tmp_path}/step_00000001)"
    assert got == [line, line]


def test_pruning_keeps_the_newest_complete_checkpoints_and_never_touches_a_folder_it_cannot_read(
        tmp_path: Path) -> None:
    from torchrec_herald.checkpoint import save_checkpoint

    foreign = tmp_path / "step_00000099"  # not a checkpoint this code can read: left alone, not counted
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"epoch": 0}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003", "step_00000099"]
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_save_that_cannot_be_written_names_the_checkpoint_and_keeps_the_earlier_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrec_herald import checkpoint

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save_checkpoint(tmp_path, 1, model, opt, {"epoch": 0})

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    from torch.distributed.checkpoint import filesystem

    monkeypatch.setattr(filesystem, "_write_files_from_queue", full)  # (inside DCP's writer: CheckpointException)
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(tmp_path, 2, model, opt, {"epoch": 0})
    assert str(e.value) == (f"cannot write the checkpoint {tmp_path}/step_00000002 (No space left on device; "
                            f"checkpoint.dir / checkpoint.root); the checkpoints saved before it are kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # (the partial save removed)

    # torch's own writer reports a short write on a full disk as "unexpected pos", never the disk's error: the line
    # says how full the disk is
    def short_write(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(filesystem, "_write_files_from_queue", short_write)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=3 << 19))
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(tmp_path, 2, model, opt, {"epoch": 0})
    assert str(e.value) == (f"cannot write the checkpoint {tmp_path}/step_00000002 (RuntimeError: [enforce fail at "
                            f"inline_container.cc:672] . unexpected pos 704 vs 598; its file system has 1.5 MiB free: "
                            f"No space left on device?; checkpoint.dir / checkpoint.root); the checkpoints saved "
                            f"before it are kept")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 40))
    with pytest.raises(OSError) as e:  # (plenty of room: the writer's own error alone)
        checkpoint.save_checkpoint(tmp_path, 2, model, opt, {"epoch": 0})
    assert "unexpected pos 704 vs 598; checkpoint.dir" in str(e.value)


def _save_beside_an_interrupted_save(rank: int, world: int, root: str) -> List[str]:
    from torchrec_herald import checkpoint

    model = torch.nn.Linear(2, 1)
    checkpoint.save_checkpoint(Path(root), 5, model, torch.optim.SGD(model.parameters(), lr=0.1), {"epoch": 0})
    return sorted(p.name for p in Path(root).iterdir())


def test_a_save_removes_the_saves_a_kill_interrupted(tmp_path: Path) -> None:
    """An interrupted save of step 3 kept its disk space until step 3 was saved again, which a resumed run past it
    never does."""
    (tmp_path / ".tmp-step_00000003").mkdir()
    (tmp_path / ".tmp-step_00000003" / "__0_0.distcp").write_bytes(bytes(1 << 20))
    assert run_multiprocess(_save_beside_an_interrupted_save, 1, str(tmp_path))[0] == ["step_00000005"]
