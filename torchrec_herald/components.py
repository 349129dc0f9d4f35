"""torchx component: ``torchx run -s local_cwd torchrec_herald/components.py:train --nproc_per_node 2 [overrides]``.

It launches ``python -m torchrec_herald.launch ... -m torchrec_herald.train <hydra overrides>`` (torchrun,
whose failure report is one line naming the cause: ``torchrec_herald/launch.py``) with the same
interpreter that runs torchx (so an activated-or-not venv works offline and ``torchrun`` need not be on
PATH). Every rank gets ``HERALD_RUN_ID`` = the torchx app id, so all ranks share one Hydra run
dir ``outputs/<app id>``. ``--max-restarts 0``: a failing rank fails the whole job at once, and
torchelastic's ``@record`` error file makes torchrun print that rank's traceback.
"""


import shlex
import sys
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.specs import macros
from torchx.specs.finder import ComponentValidationException


class ComponentArgumentError(ComponentValidationException, ValueError):
    """A component argument out of range: ``torchx run`` prints its message on one line (it reports
    ``ComponentValidationException`` without a traceback), and Python callers can catch ``ValueError``."""


def train(
    *overrides: str,
    nproc_per_node: int = 2,
    nnodes: int = 1,
    name: str = "torchrec_herald",
    image: str = "torchrec_herald:latest",
    python: str = sys.executable,
    cpu: int = 2,
    memMB: int = 8192,
    gpu: int = 0,
    h: Optional[str] = None,
    rdzv_port: int = 29500,
    run_id: str = macros.app_id,
    env: Optional[Dict[str, str]] = None,
    max_restarts: int = 0,
) -> specs.AppDef:
    """DLRM training with torchrec_herald on ``nnodes`` × ``nproc_per_node`` ranks.

    Args:
        overrides: Hydra overrides passed to ``torchrec_herald.train`` (e.g. ``planner=table_wise``).
        nproc_per_node: ranks per node.
        nnodes: number of nodes (one torchx replica each; rank 0's host is the rendezvous).
        name: job name.
        image: container image for remote schedulers (ignored by local_cwd, which uses the cwd).
        python: interpreter on the nodes (default: the one running torchx; use ``python3`` on images).
        cpu: CPUs per node (resource request).
        memMB: memory per node in MB (resource request).
        gpu: GPUs per node (resource request; 0: none). A remote scheduler gives a job only the GPUs it asks
            for, so a GPU job asks for its ``nproc_per_node`` (one rank per GPU); without them it trains on
            the CPU over gloo.
        h: named resource (overrides cpu/memMB), e.g. an AWS instance type.
        rdzv_port: c10d rendezvous port on rank 0's host (multi-node only; single node picks a free one).
        run_id: run-dir name shared by all ranks (``outputs/<run_id>``); default: the torchx app id.
        env: extra environment variables.
        max_restarts: times torchrun restarts every rank after one fails (0: the job ends); with
            ``checkpoint.every_n_steps`` a restarted job resumes from its latest complete checkpoint.
    """
    if max_restarts < 0:
        raise ComponentArgumentError(f"--max_restarts must be >= 0, got {max_restarts}")
    for key, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes)):
        if value < 1:
            raise ComponentArgumentError(f"--{key} must be >= 1, got {value}")
    if gpu < 0:
        raise ComponentArgumentError(f"--gpu must be >= 0, got {gpu}")
    launcher: List[str] = [
        python, "-m", "torchrec_herald.launch",
        "--nnodes", str(nnodes),
        "--nproc_per_node", str(nproc_per_node),
        "--max_restarts", str(max_restarts),
        "--monitor_interval", "1",
        "--rdzv_backend", "c10d",
        "--rdzv_id", macros.app_id,
    ]
    job_env = {"HERALD_RUN_ID": run_id, "LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    job_env.update(env or {})
    if nnodes == 1:
        entrypoint = python
        args = launcher[1:] + ["--rdzv_endpoint", "localhost:0", "-m", "torchrec_herald.train", *overrides]
    else:
        # rank 0's host comes from the scheduler through $TORCHX_RANK0_HOST (bash expands it on the node)
        endpoint = f"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}"  # $$: literal $ for torchx
        cmd = " ".join(shlex.quote(a) for a in launcher) + f" --rdzv_endpoint {endpoint} -m torchrec_herald.train " \
            + " ".join(shlex.quote(o) for o in overrides)
        entrypoint, args = "bash", ["-c", cmd]
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="trainer",
                image=image,
                entrypoint=entrypoint,
                args=args,
                env=job_env,
                num_replicas=nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                port_map={"c10d": rdzv_port},
                max_retries=0,
            )
        ],
    )
