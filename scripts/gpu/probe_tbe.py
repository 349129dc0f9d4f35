"""First look at the CUDA stack: herald's two fbgemm TBEs (ops/tbe.py) on CUDA against CPU on the same
rows, ids and gradients, and whether gloo carries CUDA tensors between two processes on one GPU.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/probe_tbe.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-12), both on CPU in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def fused_cold(opt_name: str) -> Dict[str, float]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_herald.ops.tbe import fused_cold_tbe

    opt = EmbOptimType[opt_name]
    rows, dim, bags = 5000, 16, 4096
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(rows, dim, generator=g) * 0.1
    lengths = torch.randint(0, 4, (bags,), generator=g)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g) ** 1  # repeats: same rows in many bags
    ids = (ids % 300)  # hot-ish: many duplicates, the exact optimizers' hard case
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    grad = torch.randn(bags, dim, generator=g)
    out: Dict[str, float] = {}
    res = {}
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        tbe = fused_cold_tbe(rows, dim, {"optimizer": opt, "learning_rate": 0.05, "eps": 1e-8}, d)
        tbe.split_embedding_weights()[0].data.copy_(w0)
        y = []
        for step in range(3):
            o = tbe(ids.to(d), offsets.to(d))
            o.backward((grad * (step + 1)).to(d))
            y.append(o.detach().cpu())
        st = tbe.split_optimizer_states()[0][0].detach().cpu() if opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD else None
        res[dev] = (torch.stack(y), tbe.split_embedding_weights()[0].detach().cpu(), st)
    out["lookup"] = rel_diff(res["cuda"][0], res["cpu"][0])
    out["weights_after_3_updates"] = rel_diff(res["cuda"][1], res["cpu"][1])
    if res["cpu"][2] is not None:
        out["rowwise_adagrad_state"] = rel_diff(res["cuda"][2], res["cpu"][2])
    return out


def dense_hot() -> Dict[str, float]:
    from torchrec_herald.ops.tbe import dense_hot_tbe, dense_lookup

    rows, dim, bags = 700, 16, 2048
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(rows, dim, generator=g)
    lengths = torch.randint(0, 5, (bags,), generator=g)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    grad = torch.randn(bags, dim, generator=g)
    res = {}
    for dev in ("cpu", "cuda"):
        d = torch.device(dev)
        tbe = dense_hot_tbe(rows, dim, d).to(d)
        with torch.no_grad():
            tbe.weights.copy_(w0.view(-1))
        o = tbe(ids.to(d), offsets.to(d))
        o.backward(grad.to(d))
        ws = w0.clone().to(d).requires_grad_(True)  # a leaf on each device
        o2 = dense_lookup(ws, ids.to(d), offsets.to(d))
        o2.backward(grad.to(d))
        res[dev] = (o.detach().cpu(), tbe.weights.grad.detach().cpu().view(rows, dim), o2.detach().cpu(), ws.grad.cpu())
    return {"dense_tbe_lookup": rel_diff(res["cuda"][0], res["cpu"][0]),
            "dense_tbe_grad": rel_diff(res["cuda"][1], res["cpu"][1]),
            "dense_lookup_op": rel_diff(res["cuda"][2], res["cpu"][2]),
            "dense_lookup_op_grad": rel_diff(res["cuda"][3], res["cpu"][3])}


def _gloo_cuda_worker(rank: int, port: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        d = torch.device("cuda", 0)
        x = torch.arange(6, dtype=torch.float32, device=d) + 10 * rank
        out = torch.empty(6, device=d)
        dist.all_to_all_single(out, x, [2, 4] if rank == 0 else [4, 2], [2, 4] if rank == 0 else [4, 2])
        y = torch.full((2,), float(rank), device=d)
        dist.all_reduce(y)
        z = torch.empty(4, device=d)
        dist.all_gather_into_tensor(z, torch.full((2,), float(rank), device=d))
        q.put((rank, "ok", out.cpu().tolist(), y.cpu().tolist(), z.cpu().tolist()))
        dist.destroy_process_group()
    except BaseException as e:
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def gloo_cuda() -> Dict[str, Any]:
    from torchrec_herald.dist_utils import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=_gloo_cuda_worker, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = sorted(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(30)
    return {"ranks": [list(map(str, g)) for g in got]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    checks: Dict[str, Callable[[], Any]] = {
        "fused_cold_EXACT_SGD": lambda: fused_cold("EXACT_SGD"),
        "fused_cold_EXACT_ROWWISE_ADAGRAD": lambda: fused_cold("EXACT_ROWWISE_ADAGRAD"),
        "dense_hot": dense_hot,
        "gloo_cuda_two_processes": gloo_cuda,
    }
    report: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in checks.items():
        try:
            report[name] = fn()
        except BaseException:
            report[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(report[name])[:1500], flush=True)
    a.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
