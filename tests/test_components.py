"""Tests of the torchx component ``torchrec_herald/components.py:train``.

Unit tests check the AppDef it returns (exact launcher argv, env, resources, multi-node bash
command after torchx macro substitution). The ``slow`` end-to-end tests launch it for real with
``torchx run -s local_cwd`` on 2 CPU ranks (as ``make run`` does) and are part of the default suite.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torchx.specs as specs
from torchx.specs import file_linter, macros
from torchx.specs.builders import materialize_appdef

from torchrec_herald.components import train

REPO = Path(__file__).resolve().parents[1]
COMPONENT = "torchrec_herald/components.py:train"
TORCHX = Path(sys.executable).parent / "torchx"  # the venv's torchx, not whatever is on PATH
OVERRIDES = ("planner=table_wise", "data.num_train_batches=8")


def node_view(role: specs.Role, app_id: str = "app-123") -> specs.Role:
    """The role as a node receives it: torchx macros substituted (as the schedulers do)."""
    values = macros.Values(img_root="", app_id=app_id, replica_id="0", rank0_env="TORCHX_RANK0_HOST")
    return values.apply(role)


# --------------------------------------------------------------------------- AppDef: single node


def test_single_node_launcher_argv_exact() -> None:
    app = train(*OVERRIDES)
    assert isinstance(app, specs.AppDef)
    assert app.name == "torchrec_herald"
    assert len(app.roles) == 1
    role = app.roles[0]
    assert role.entrypoint == sys.executable
    assert role.args == [
        "-m", "torchrec_herald.launch",
        "--nnodes", "1",
        "--nproc_per_node", "2",
        "--max_restarts", "0",
        "--monitor_interval", "1",
        "--rdzv_backend", "c10d",
        "--rdzv_id", macros.app_id,
        "--rdzv_endpoint", "localhost:0",
        "-m", "torchrec_herald.train",
        "planner=table_wise", "data.num_train_batches=8",
    ]


def test_single_node_args_structure() -> None:
    overrides = ["data=criteo_tsv", "data.paths=[a.tsv,b.tsv]", "batch_size=64", "+extra='x y'"]
    args = train(*overrides, nproc_per_node=3).roles[0].args
    assert args[:2] == ["-m", "torchrec_herald.launch"]

    def value(flag: str) -> str:
        assert args.count(flag) == 1, flag
        return args[args.index(flag) + 1]

    assert value("--nproc_per_node") == "3"
    assert value("--max_restarts") == "0"
    assert value("--rdzv_endpoint") == "localhost:0"
    # the module, then the Hydra overrides verbatim and in order, nothing after them
    i = args.index("torchrec_herald.train")
    assert args[i - 1] == "-m"
    assert args[i + 1:] == overrides


def test_single_node_no_overrides() -> None:
    args = train().roles[0].args
    assert args[-2:] == ["-m", "torchrec_herald.train"]


def test_run_id_env_default_is_app_id_macro() -> None:
    role = train().roles[0]
    assert role.env["HERALD_RUN_ID"] == macros.app_id == "${app_id}"
    # what the ranks see: the torchx app id
    assert node_view(role, app_id="torchrec_herald-xyz").env["HERALD_RUN_ID"] == "torchrec_herald-xyz"


def test_run_id_env_explicit() -> None:
    role = train(run_id="my_run").roles[0]
    assert role.env["HERALD_RUN_ID"] == "my_run"
    assert node_view(role).env["HERALD_RUN_ID"] == "my_run"


def test_env_extra_and_override() -> None:
    env = train(env={"FOO": "1", "LOGLEVEL": "INFO"}).roles[0].env
    assert env["FOO"] == "1"
    assert env["LOGLEVEL"] == "INFO"  # user env wins over the component's defaults
    assert env["OMP_NUM_THREADS"] == "1"
    assert "HERALD_RUN_ID" in env


def test_resources_replicas_and_names() -> None:
    app = train(name="job", image="img:1", cpu=7, memMB=1234, nnodes=1)
    role = app.roles[0]
    assert app.name == "job"
    assert role.name == "trainer"
    assert role.image == "img:1"
    assert role.num_replicas == 1
    assert role.max_retries == 0
    assert role.resource.cpu == 7
    assert role.resource.memMB == 1234
    assert role.resource.gpu == 0
    assert train(gpu=8, nproc_per_node=8).roles[0].resource.gpu == 8  # (a remote scheduler gives only those asked for)
    with pytest.raises(ValueError, match=r"^--gpu must be >= 0, got -1$"):
        train(gpu=-1)


def test_named_resource_h() -> None:
    role = train(h="aws_t3.medium", cpu=99, memMB=99).roles[0]  # h wins over cpu/memMB
    assert role.resource == specs.get_named_resources("aws_t3.medium")
    assert role.resource.cpu == 2


def test_python_option() -> None:
    role = train(python="python3").roles[0]
    assert role.entrypoint == "python3"
    assert role.args[:2] == ["-m", "torchrec_herald.launch"]


@pytest.mark.parametrize("kw", [{"nproc_per_node": 0}, {"nproc_per_node": -1}, {"nnodes": 0}])
def test_invalid_sizes_raise(kw) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        train(**kw)


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
    (["--nproc_per_node", "0"], "--nproc_per_node must be >= 1, got 0"),
    (["--max_restarts", "-1"], "--max_restarts must be >= 0, got -1"),
])
def test_torchx_run_with_an_argument_out_of_range_prints_one_message_without_a_traceback(
        args: List[str], message: str) -> None:
    proc = subprocess.run([str(TORCHX), "run", "-s", "local_cwd", COMPONENT, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_component_lints_clean() -> None:
    """``torchx run`` validates the component file: no linter messages."""
    assert file_linter.validate(str(REPO / "torchrec_herald" / "components.py"), "train") == []


def test_cli_materialization() -> None:
    """How ``torchx run ... components.py:train --nproc_per_node 2 --run_id r <overrides>`` builds it."""
    app = materialize_appdef(
        train, ["--nproc_per_node", "2", "--run_id", "r", "planner=row_wise", "batch_size=64"]
    )
    role = app.roles[0]
    assert role.env["HERALD_RUN_ID"] == "r"
    assert role.args[role.args.index("--nproc_per_node") + 1] == "2"
    assert role.args[-3:] == ["torchrec_herald.train", "planner=row_wise", "batch_size=64"]


# --------------------------------------------------------------------------- AppDef: multi node


def test_multi_node_bash_command() -> None:
    role = train(*OVERRIDES, nnodes=2).roles[0]
    assert role.entrypoint == "bash"
    assert role.num_replicas == 2
    assert role.args[0] == "-c"
    assert len(role.args) == 2
    assert role.port_map == {"c10d": 29500}

    node = node_view(role, app_id="app-123")
    cmd = node.args[1]
    assert cmd.startswith(f"{sys.executable} -m torchrec_herald.launch ")
    assert "--nnodes 2" in cmd
    assert "--nproc_per_node 2" in cmd
    assert "--max_restarts 0" in cmd
    # rank 0's host: expanded by bash on the node from the scheduler's env var ($$ -> literal $)
    assert "--rdzv_endpoint ${TORCHX_RANK0_HOST:=localhost}:29500 " in cmd
    assert "$$" not in cmd and "${rank0_env}" not in cmd and "${app_id}" not in cmd
    assert "app-123" in cmd  # --rdzv_id
    assert cmd.endswith("-m torchrec_herald.train planner=table_wise data.num_train_batches=8")
    assert node.env["HERALD_RUN_ID"] == "app-123"


def test_multi_node_rdzv_port() -> None:
    role = train(nnodes=3, rdzv_port=1234).roles[0]
    cmd = node_view(role).args[1]
    assert "--nnodes 3" in cmd
    assert "${TORCHX_RANK0_HOST:=localhost}:1234" in cmd
    assert role.port_map == {"c10d": 1234}


def _argv_printer(tmp_path: Path) -> Path:
    """A stand-in ``python`` that prints its argv one per line (NUL-free, so tests can split)."""
    script = tmp_path / "fake python"  # a space: the interpreter path must be quoted too
    script.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("rank0_host", [None, "node-0.example"])
def test_multi_node_command_as_bash_runs_it(tmp_path: Path, rank0_host) -> None:
    """Run the node's ``bash -c`` command with a fake interpreter: exact argv, endpoint expanded."""
    overrides = ["planner=table_wise", "data.paths=[/d/a b.tsv,/d/c.tsv]", "+note='it''s'", "x=$HOME"]
    fake = _argv_printer(tmp_path)
    node = node_view(train(*overrides, nnodes=2, python=str(fake)).roles[0], app_id="app-7")
    env = {k: v for k, v in os.environ.items() if k != "TORCHX_RANK0_HOST"}
    if rank0_host:
        env["TORCHX_RANK0_HOST"] = rank0_host
    out = subprocess.run(
        [node.entrypoint, *node.args], env=env, capture_output=True, text=True, check=True, timeout=30
    )
    argv = out.stdout.splitlines()
    assert argv == [
        "-m", "torchrec_herald.launch",
        "--nnodes", "2",
        "--nproc_per_node", "2",
        "--max_restarts", "0",
        "--monitor_interval", "1",
        "--rdzv_backend", "c10d",
        "--rdzv_id", "app-7",
        "--rdzv_endpoint", f"{rank0_host or 'localhost'}:29500",
        "-m", "torchrec_herald.train",
        *overrides,  # verbatim: spaces, quotes and $ survive the shell
    ]


# --------------------------------------------------------------------------- end to end (slow)


def _launch(run_id: str, *overrides: str, timeout: float, max_restarts: int = 0,
            env_extra: Optional[Dict[str, str]] = None) -> Tuple[subprocess.CompletedProcess, float]:
    assert TORCHX.exists(), TORCHX
    cmd: List[str] = [
        str(TORCHX), "run", "--log", "-s", "local_cwd", COMPONENT,
        "--nproc_per_node", "2", "--max_restarts", str(max_restarts), "--run_id", run_id, *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("HERALD_RUN_ID", "RANK", "WORLD_SIZE")}
    env.update(env_extra or {})
    t0 = time.monotonic()
    # local_cwd runs the job in the cwd: it must be the repo root
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _combined(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture
def run_id():
    rid = f"pytest-{uuid.uuid4().hex[:12]}"
    yield rid
    shutil.rmtree(REPO / "outputs" / rid, ignore_errors=True)


@pytest.mark.slow
def test_e2e_torchx_local_cwd_two_ranks(run_id: str) -> None:
    proc, elapsed = _launch(
        run_id, "data.num_train_batches=8", "data.num_eval_batches=2", "batch_size=64", timeout=240
    )
    out = _combined(proc)
    assert proc.returncode == 0, out[-6000:]
    assert "| eval AUC |" in out
    assert "| steps | 8 |" in out
    run_dir = REPO / "outputs" / run_id
    assert f"metrics: {run_dir / 'metrics.json'}" in out

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 8
    assert metrics["world_size"] == 2
    assert metrics["local_batch_size"] == 64
    assert metrics["global_batch_size"] == 128
    assert metrics["eval"]["samples"] == 2 * 128
    assert 0.0 <= metrics["eval"]["auc"] <= 1.0
    assert metrics["eval"]["logloss"] > 0
    assert metrics["samples_per_s"] > 0
    assert set(metrics["plan"]) == {f"t_cat_{i}" for i in range(26)}
    assert metrics["traffic_per_step_total"]["bytes"] > 0
    # the Hydra overrides reached the ranks
    assert metrics["config"]["data"]["num_train_batches"] == 8
    assert metrics["config"]["batch_size"] == 64
    # both ranks wrote into the one shared run dir
    for r in (0, 1):
        assert (run_dir / "logs" / f"rank{r}.log").is_file()
        assert (run_dir / ".hydra" / f"rank{r}" / "config.yaml").is_file()
    print(f"e2e launch took {elapsed:.1f} s")


def _last_lines(out: str, n: int = 10) -> str:
    """The last ``n`` non-empty lines of a launch's output as one whitespace-normalised string (torchx
    wraps its final status at 80 columns and doubles quotes in YAML)."""
    lines = [ln for ln in out.splitlines() if ln.strip()][-n:]
    return " ".join(" ".join(lines).replace("''", "'").split())


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (["planner=herald", "pipeline=herald", "compare_with=table_wise", "pipeline.window=100000"],
     "ValueError: pipeline.window=100000 is larger than the 1000 batch(es) the data loader has "
     "(data.num_train_batches); lower pipeline.window"),
    (["pipeline=herald"], "ValueError: pipeline=herald needs planner=herald"),
    (["planner=herald", "pipeline=herald", "compare_with=table_wise", "checkpoint.dir=/proc/herald-ckpt",
      "checkpoint.every_n_steps=5"],
     "ValueError: checkpoint.dir=/proc/herald-ckpt is not writable: no file can be created in /proc"),
])
def test_e2e_bad_setting_fails_before_training_with_one_line(run_id: str, overrides: List[str],
                                                             message: str) -> None:
    """A bad herald setting fails before anything trains (with compare_with: before the baseline). The
    first failure line the launch prints names the cause, the launch prints no traceback, and the same
    line, naming the key, ends its output (torchx's final status). One case per kind of check: against
    the data, between config groups, against the file system; every other setting's message is pinned
    in-process (``test_newcomer.py``), through the same preflight and the same one-line report."""
    proc, elapsed = _launch(run_id, *overrides, timeout=240)
    out = _combined(proc)
    assert proc.returncode != 0, out[-6000:]
    assert message in _first_failure_line(out), out[-3000:]
    assert "Traceback" not in out and len(out.splitlines()) < 30, out
    assert message in _last_lines(out), out[-3000:]
    assert f"traceback: {REPO / 'outputs' / run_id / 'logs' / 'rank'}" in _last_lines(out), out[-3000:]
    # the log of the rank that failed first (torchrun may stop the other before it writes its own)
    named = re.search(r"traceback: (\S+/logs/rank\d+\.log)", _last_lines(out))
    assert named, _last_lines(out)
    assert "Traceback (most recent call last)" in Path(named.group(1)).read_text()
    assert not list((REPO / "outputs" / run_id).glob("**/metrics.json"))  # nothing trained, baseline included
    assert "train:" not in out  # no progress bar ever started
    print(f"{overrides[-1]} failed in {elapsed:.1f} s")


def _first_failure_line(out: str) -> str:
    """The first line of a launch's output that reports a failure (torchx's own INFO lines aside)."""
    for line in out.splitlines():
        if line.startswith("torchx ") or re.search(r"\] INFO ", line):  # (torchx's lines; a rank's INFO log lines)
            continue
        if re.search(r"(?i)error|failed|exception|traceback", line):
            return " ".join(line.split())
    return ""


@pytest.mark.slow
def test_e2e_window_larger_than_a_files_batches_fails_before_the_baseline(run_id: str, tmp_path: Path) -> None:
    f = tmp_path / "day_0.tsv"
    f.write_text(("1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26) + "\n") * 300)
    proc, _ = _launch(run_id, "planner=herald", "planner.link_mbit=null", "pipeline=herald", "compare_with=table_wise",
                      "pipeline.window=5",
                      "batch_size=32", "data=criteo_tsv", f"data.paths={f}", timeout=240)
    out = _combined(proc)
    assert proc.returncode != 0, out[-6000:]
    assert ("ValueError: pipeline.window=5 is larger than the 4 global batch(es) of 2 × 32 samples that "
            "CriteoTSV(day_0.tsv) holds (data.paths); lower pipeline.window") in _first_failure_line(out), out
    assert not list((REPO / "outputs" / run_id).glob("**/metrics.json"))  # the baseline did not train


@pytest.mark.slow
def test_e2e_empty_data_file_is_named(run_id: str, tmp_path: Path) -> None:
    empty = tmp_path / "day_0.tsv"
    empty.write_text("")
    proc, _ = _launch(run_id, "data=criteo_tsv", f"data.paths={empty}", timeout=240)
    out = _combined(proc)
    assert proc.returncode != 0, out[-6000:]
    assert f"DataFormatError: {empty}:1: the file is empty" in _last_lines(out), out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("turns", [[], ["compare_turn_steps=0"]])  # in turns (the default), one after the other
def test_e2e_compare_with_leaves_a_comparison_report(run_id: str, turns: List[str]) -> None:
    """``make run``'s command (herald vs its stock baseline) leaves comparison.md/json/png in the run dir, the two
    runs trained in turns or one after the other."""
    proc, _ = _launch(run_id, "planner=herald", "planner.link_mbit=null", "pipeline=herald", "compare_with=table_wise",
                      "pipeline.window=3", *turns,
                      "data.num_train_batches=8", "data.num_eval_batches=2", "batch_size=64", timeout=300)
    out = _combined(proc)
    assert proc.returncode == 0, out[-6000:]
    run_dir = REPO / "outputs" / run_id
    assert f"comparison: {run_dir / 'comparison.png'} (and comparison.md, comparison.json)" in out
    data = json.loads((run_dir / "comparison.json").read_text())
    assert list(data["runs"]) == ["table_wise (baseline)", "herald + scheduling"]
    base, herald = (json.loads(p.read_text()) for p in (run_dir / "baseline_table_wise" / "metrics.json",
                                                         run_dir / "metrics.json"))
    assert data["runs"]["herald + scheduling"]["summary"] == pytest.approx(herald["summary"], nan_ok=True)
    assert data["runs"]["table_wise (baseline)"]["summary"] == pytest.approx(base["summary"], nan_ok=True)
    assert (run_dir / "comparison.md").read_text().startswith("| metric | table_wise (baseline) | herald + scheduling |")
    assert (run_dir / "comparison.png").stat().st_size > 20_000
    assert (run_dir / "training.png").stat().st_size > 0 and (run_dir / "baseline_table_wise" / "training.png").exists()
    # no rank warns that fbgemm's dense lookup has no autograd kernel (ops/tbe.py registers one)
    logs = list(run_dir.glob("**/logs/rank*.log"))
    assert len(logs) == 4 and not [p for p in logs if "autograd kernel was not registered" in p.read_text()]
    assert "autograd kernel was not registered" not in out


def _final_weights(checkpoint_dir: Path, step: int, out: Path) -> Dict[str, Any]:
    """The model of a run's checkpoint at ``step`` as full tensors (DCP's own converter)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint_dir / f"step_{step:08d}"), str(out))
    return torch.load(out, weights_only=False)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("config", [  # (herald with SGD resumes through the same code as with row-wise
    # Adagrad, which also restores optimizer state: three launches a case, so it is left out)
    ["planner=table_wise", "optimizer=sgd"],
    ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "optimizer=rowwise_adagrad"],
])
def test_e2e_a_killed_run_resumes_when_the_same_command_is_run_again(config: List[str], tmp_path: Path) -> None:
    """2 ranks, checkpoints every 5 steps; rank 1 is SIGKILLed after step 12 and the job ends. Running the
    identical command again (a new torchx app id, hence a new run dir) finds the run's checkpoint folder,
    which is named after its config, resumes from step 10, says so, and ends with the per-step losses
    and final weights of an uninterrupted run, bit for bit. Its figures count this attempt: 10 steps,
    bytes per step over those steps (equal to the uninterrupted run's where every step sends the same
    bytes: TABLE_WISE), samples/s over this attempt's time."""
    import torch

    common = config + ["data.num_train_batches=20", "data.num_eval_batches=2", "batch_size=64",
                       "checkpoint.every_n_steps=5"]
    runs = {}
    for kind, root in (("whole", tmp_path / "whole"), ("killed", tmp_path / "killed")):
        command = common + [f"checkpoint.root={root}"]
        attempts = [{"HERALD_FAULT_KILL_AT_STEP": "12", "HERALD_FAULT_KILL_RANK": "1"}, {}] if kind == "killed" else [{}]
        for i, env in enumerate(attempts):
            rid = f"pytest-{uuid.uuid4().hex[:12]}"
            try:
                proc, _ = _launch(rid, *command, timeout=240, env_extra=env)
                out = _combined(proc)
                if i + 1 < len(attempts):
                    assert proc.returncode != 0, out[-3000:]  # the kill ended the job
                    continue
                assert proc.returncode == 0, out[-6000:]
                run_dir = REPO / "outputs" / rid
                metrics = json.loads((run_dir / "metrics.json").read_text())
                weights = _final_weights(Path(metrics["checkpoint_dir"]), 20, tmp_path / f"{kind}.pt")
                runs[kind] = (json.loads((run_dir / "losses.json").read_text()), weights, out, metrics)
            finally:
                shutil.rmtree(REPO / "outputs" / rid, ignore_errors=True)
    (l1, w1, out1, m1), (l2, w2, out2, m2) = runs["whole"], runs["killed"]
    assert "resuming from checkpoint" in out2 and "step_00000010: step 10 (epoch 0, batch 10 of it)" in out2, \
        out2[-3000:]
    assert "resuming from checkpoint" not in out1
    assert len(l1) == len(l2) == 20 and l1 == l2
    assert set(w1) == set(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert (m1["steps"], m1["steps_this_attempt"], m1["resumed_from_step"]) == (20, 20, None)
    assert (m2["steps"], m2["steps_this_attempt"], m2["resumed_from_step"]) == (20, 10, 10)
    assert m2["resumed_from"].endswith("step_00000010")
    b1, b2 = (m["summary"]["bytes_per_step_all_ranks"] for m in (m1, m2))
    if "planner=table_wise" in config:
        assert b2 == b1
    else:  # herald's bytes vary from step to step; a count over 20 steps divided by 10 would be 2x
        assert 0.75 <= b2 / b1 <= 1.25, (b1, b2)
    assert m2["samples_per_s"] == pytest.approx(10 * 128 / m2["train_time_s"])


@pytest.mark.slow
def test_e2e_resume_false_starts_fresh_and_keeps_the_earlier_checkpoints(tmp_path: Path) -> None:
    command = ["planner=table_wise", "data.num_train_batches=6", "data.num_eval_batches=1", "batch_size=32",
               "checkpoint.every_n_steps=3", f"checkpoint.root={tmp_path}", "eval=false"]
    outs = []
    for extra in ([], ["checkpoint.resume=false"]):
        rid = f"pytest-{uuid.uuid4().hex[:12]}"
        try:
            proc, _ = _launch(rid, *command, *extra, timeout=240)
            outs.append(_combined(proc))
            assert proc.returncode == 0, outs[-1][-3000:]
            outs.append(json.loads((REPO / "outputs" / rid / "metrics.json").read_text()))
        finally:
            shutil.rmtree(REPO / "outputs" / rid, ignore_errors=True)
    assert outs[3]["steps_this_attempt"] == 6 and outs[3]["resumed_from_step"] is None
    # the same command once more: the run is complete, its figures are reported, nothing retrains
    rid = f"pytest-{uuid.uuid4().hex[:12]}"
    try:
        proc, _ = _launch(rid, *command, timeout=240)
        out = _combined(proc)
        assert proc.returncode == 0, out[-3000:]
        assert "the run already finished at step 6" in out
        assert json.loads((REPO / "outputs" / rid / "metrics.json").read_text()) == outs[3]
    finally:
        shutil.rmtree(REPO / "outputs" / rid, ignore_errors=True)
    assert "starting fresh; the earlier checkpoints of this run were moved to" in outs[2]
    folders = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))  # (a run's lock beside its folder)
    name = Path(outs[1]["checkpoint_dir"]).name
    assert folders[0] == name and len(folders) == 2 and folders[1].startswith(f"{name}.set-aside-")
    assert (tmp_path / folders[1] / "step_00000006").is_dir()  # the first run's checkpoints, kept


def test_max_restarts_reaches_torchrun() -> None:
    role = train("planner=herald", max_restarts=3).roles[0]
    assert role.args[role.args.index("--max_restarts") + 1] == "3"
    with pytest.raises(ValueError, match="max_restarts must be >= 0, got -1"):
        train(max_restarts=-1)


@pytest.mark.slow
def test_e2e_fail_fast_missing_file(run_id: str) -> None:
    proc, elapsed = _launch(run_id, "data=criteo_tsv", "data.paths=/nonexistent/x.tsv", timeout=240)
    out = _combined(proc)
    assert proc.returncode != 0, out[-6000:]
    # the failing rank's error ends the output
    assert "FileNotFoundError: data file(s) not found: /nonexistent/x.tsv" in _last_lines(out), out[-6000:]
    assert "/nonexistent/x.tsv" in out
    assert elapsed < 150  # (a rank left waiting would last the 300 s gloo timeout; start-up is 30 s here, ~60 on CI)
    print(f"fail-fast launch took {elapsed:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [("foo=1", "Key 'foo' not in 'TrainConfig'"), ("planner=bogus", "Could not find 'planner/bogus'")],
)
def test_e2e_bad_hydra_override(run_id: str, override: str, message: str) -> None:
    proc, elapsed = _launch(run_id, override, timeout=240)
    out = _combined(proc)
    assert proc.returncode != 0, out[-6000:]
    assert message in _last_lines(out), out[-6000:]
    assert not (REPO / "outputs" / run_id / "metrics.json").exists()
    print(f"{override} launch took {elapsed:.1f} s")
