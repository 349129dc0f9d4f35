"""Process-group setup and a small multi-process launcher used by tests and benchmarks."""

from __future__ import annotations

import datetime
import io
import logging
import os
import queue as queue_mod
import time
import socket
import traceback
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)


#: environment variable naming the process group's backend instead of :func:`default_backend`'s choice
BACKEND_ENV = "HERALD_DIST_BACKEND"
BACKENDS = ("gloo", "cpu:gloo,cuda:nccl")  # (nccl alone: the trainer's CPU reductions would have no backend)


def collective_device(pg: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a collective's tensors go on ``pg``: the current CUDA device where the group has a CUDA backend
    (``cpu:gloo,cuda:nccl`` on a GPU host, or a user's ``nccl`` group, which refuses CPU tensors), else the CPU."""
    backend = str(dist.get_backend(pg))
    if torch.cuda.is_available() and ("cuda" in backend or backend == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_unseen_by_host() -> bool:
    """The job's collectives never block the host (NCCL's, CUDA tensors): its host-side waits and arrivals miss
    their communication, which its compute then holds."""
    return collective_device().type == "cuda"


def device_sync(device: Any) -> Optional[Callable[[], None]]:
    """What waits for ``device``'s queued work (a CUDA device's stream), for a clock that times the device's work;
    None on a CPU, where the host's clock is the work's."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(dev)


def rank0_outcome(work: Callable[[], Optional[str]]) -> Optional[str]:
    """Run ``work`` on rank 0 alone and give every rank what it returned, one line of error or None (collective
    where a process group of several ranks is up): every rank can then raise the same error, where rank 0
    raising alone would leave the others waiting for it in their next collective."""
    outcome = work() if not dist.is_initialized() or dist.get_rank() == 0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared: List[Optional[str]] = [outcome]
        dist.broadcast_object_list(shared, src=0)
        outcome = shared[0]
    return outcome


def with_hosts(value: Any) -> List[Tuple[Any, str]]:
    """Every rank's ``value`` beside the name of its host, in rank order (collective where a process group of several
    ranks is up; this rank's alone otherwise): what the checks that ranks on several hosts must agree on gather."""
    mine = (value, socket.gethostname())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [(v, str(host)) for v, host in every]


def default_backend() -> str:
    """``cpu:gloo,cuda:nccl`` when CUDA is present (CUDA tensors over nccl; the scheduler's CPU metadata
    and the trainer's CPU reductions over gloo, in the same process group), gloo otherwise.
    ``HERALD_DIST_BACKEND=gloo`` lets several ranks share one GPU (:func:`local_device`), gloo carrying
    their CUDA tensors: NCCL takes one rank per device."""
    chosen = os.environ.get(BACKEND_ENV)
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={chosen!r}: expected one of {list(BACKENDS)} (cpu:gloo,cuda:nccl: NCCL "
                             f"for CUDA tensors, gloo for the trainer's CPU ones; the default on a GPU host)")
        return chosen
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` modulo the GPUs this process sees (a launcher that gives each
    rank one GPU of its own shows it as ``cuda:0``; ranks beyond the GPUs share them, which NCCL refuses
    and gloo allows), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def init_distributed(timeout_s: int = 600) -> tuple[int, int, torch.device]:
    """Initialise the default process group from torchrun's env vars (or a 1-rank group).

    Returns (rank, world_size, device).
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = default_backend()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and attempt != "0":
            dist.init_process_group(backend=backend, store=_attempt_store(int(attempt), timeout),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
        if backend == "gloo" and torch.cuda.is_available():
            logger.warning("%s=gloo: CUDA tensors travel over gloo (through the host)", BACKEND_ENV)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return rank, world, device


def _attempt_store(attempt: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of a restarted torchrun attempt, under a prefix of its own: torchrun reuses
    its agent's store across restarts, and gloo would otherwise read the dead attempt's rank addresses
    and fail to connect (written by hand: ``init_process_group``'s env:// store has no per-attempt
    prefix when the agent hosts it)."""
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=not use_agent and rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"torchrec_herald/attempt_{attempt}", store)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the fork server that every :func:`run_multiprocess` rank is forked from (importing
#: torch, TorchRec and fbgemm costs each spawned rank about 4 s of CPU: most of a short test's time)
_PRELOAD = ["torch", "torch.distributed", "fbgemm_gpu", "torchrec", "torchrec.distributed",
            "torchrec_herald.trainer"]


def _rank_context() -> Any:
    """The multiprocessing context of :func:`run_multiprocess`'s ranks: a fork server that has imported
    :data:`_PRELOAD` (started on first use, kept for the parent's life), or plain spawn where the
    platform has none, and on a CUDA machine (the imports may touch the CUDA driver, which a forked
    process cannot use then). A rank forked from it gets the parent's environment and working directory
    from :func:`_worker`, as a spawned one inherits them."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods() or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
            queue: Any, env: Optional[dict] = None, cwd: Optional[str] = None) -> None:
    if env is not None:  # the parent's, now (a fork server's child has the server's, from its start)
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=300))
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # by value: tensors sent through the queue would share fds that die with us
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # report to the parent, which raises
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_multiprocess(fn: Callable[..., Any], world_size: int, *args: Any,
                     timeout_s: float = 900) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results.

    ``fn`` must be picklable (module level). The first rank error is raised here as RuntimeError
    with that rank's traceback; remaining ranks are terminated (no hang).
    """
    ctx = _rank_context()
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, cwd), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Optional[Any]] = [None] * world_size
    deadline = time.monotonic() + timeout_s
    try:
        pending = set(range(world_size))
        while pending:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r in pending if procs[r].exitcode is not None]
                if dead:  # a rank died without reporting (signal, os._exit): fail, don't wait
                    time.sleep(2.0)  # let a report in flight arrive first
                    if queue.empty():
                        raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                           "without reporting a result")
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} did not finish in {timeout_s} s")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed: {payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            pending.discard(rank)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return results
