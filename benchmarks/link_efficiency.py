"""The share of a ``tc tbf`` rate single gloo collectives get between 2 ranks in network namespaces (the plumbing
of ``bench_bandwidth.py``), by collective, payload, idle gap and alignment: why the model of time's one link
efficiency misses stock's step at 50 Mbit/s (RESULTS.md, "What a collective gets of a shaped link").

    sudo .venv/bin/python benchmarks/link_efficiency.py --rates 400 200 50 25 --tag base
        [--sysctl net.ipv4.tcp_slow_start_after_idle=0] [--quick: fewer sizes, and a hand-written receive-first
        exchange beside gloo's all_to_all] [--out benchmarks/results/link_efficiency]

Modes: ``stream`` times calls back to back (a training loop's ranks drift out of step), ``barrier`` aligns the
ranks with a barrier before each timed call (the barrier outside the timed window).

Payload convention: "bytes sent per rank" = what one rank sends to its peer (the TrafficMeter convention):
all_to_all_single input = 2 x payload (half stays local), all_reduce tensor = payload bytes.
efficiency = payload*8 / time / rate.
Writes ``<out>/raw_<tag>.json`` (every call's time, TCP counters, tc counters).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_bandwidth import limit  # noqa: E402
from netns_crosscheck import run_in_namespaces, setup, teardown  # noqa: E402

SIZES = [16_000, 19_000, 37_000, 40_000, 64_000, 110_000, 213_000, 1_000_000, 4_000_000]


def snmp() -> dict:
    d = {}
    for f in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(f).read_text().splitlines()
        for h, v in zip(lines[0::2], lines[1::2]):
            pre, keys = h.split(":", 1)
            _, vals = v.split(":", 1)
            if pre not in ("Tcp", "TcpExt"):
                continue
            for k, x in zip(keys.split(), vals.split()):
                d[f"{pre}{k}"] = int(x)
    return d


KEEP = ["TcpRetransSegs", "TcpOutSegs", "TcpExtTCPLossProbes", "TcpExtTCPTimeouts", "TcpExtTCPFastRetrans",
        "TcpExtTCPSlowStartRetrans", "TcpExtTCPSackRecovery", "TcpExtTCPLostRetransmit", "TcpExtTCPSpuriousRTOs",
        "TcpExtDelayedACKs", "TcpExtTCPLossProbeRecovery"]


def sdiff(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in KEEP}


def ss_snapshot() -> list:
    """cwnd/rtt/pacing of this rank's established gloo TCP connections."""
    try:
        txt = subprocess.run(["ss", "-tin", "state", "established"], capture_output=True, text=True).stdout
    except Exception:
        return []
    res, lines = [], txt.splitlines()[1:]
    for head, info in zip(lines[0::2], lines[1::2]):
        f = {}
        for tok in info.split():
            for key in ("cwnd:", "rtt:", "pacing_rate", "retrans:", "bbr:", "delivery_rate", "ssthresh:"):
                if tok.startswith(key):
                    f[key.rstrip(":")] = tok.split(":", 1)[1] if ":" in tok else tok
        res.append({"conn": " ".join(head.split()[2:4]), **f})
    return res


def worker(rate: int, out: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ifname = f"eth{rank}"
    txf = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")

    def a2a(p):
        x = torch.ones(2 * p // 4)
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x)

    def ar(p):
        x = torch.ones(p // 4)
        return lambda: dist.all_reduce(x)

    peer = 1 - rank

    def p2p(p):  # the a2a's exchange by hand, receive posted BEFORE send (gloo's alltoall sends first)
        x = torch.ones(p // 4)
        y = torch.empty_like(x)

        def f():
            r = dist.irecv(y, peer)
            s = dist.isend(x, peer)
            s.wait()
            r.wait()
        return f

    OPS = {"a2a": a2a, "allreduce": ar}
    if quick:
        OPS["p2p_recvfirst"] = p2p

    # warm-up: open connections, let cc state settle
    for _ in range(3):
        a2a(1_000_000)()
        ar(1_000_000)()
    dist.barrier()

    def nreps(p):
        exp = p * 8 / (rate * 1e6) / 0.7
        return max(6, min(20, int(5.0 / max(exp, 1e-9))))

    rows = []

    def measure(op, p, gap, mode, reps):
        f = OPS[op](p)
        for _ in range(2):  # untimed warm-ups of this config
            dist.barrier()
            f()
        dist.barrier()
        s0, k0 = snmp(), int(txf.read_text())
        ts = []
        tl0 = time.perf_counter()
        for _ in range(reps):
            if mode == "barrier":
                dist.barrier()
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        loop = time.perf_counter() - tl0
        k1, s1 = int(txf.read_text()), snmp()
        rows.append({"kind": "single", "op": op, "payload": p, "gap_ms": gap * 1000, "mode": mode, "reps": reps,
                     "times": ts, "loop_s": loop, "kernel_tx": k1 - k0, "snmp": sdiff(s0, s1),
                     "ss": ss_snapshot()})

    sizes = SIZES if not quick else [16_000, 64_000, 213_000, 1_000_000] + ([4_000_000] if rate >= 50 else [])
    for p in sizes:
        for op in OPS:
            for gap in (0.0, 0.010):
                for mode in ("stream", "barrier"):
                    measure(op, p, gap, mode, nreps(p))
    # long idle (beyond the RTO: slow start after idle / BBR idle restart)
    for p in (213_000, 1_000_000):
        for op in OPS:
            measure(op, p, 0.300, "stream", 8)

    # sequences
    def seq(name, parts, iters=20, gap_after=0.010):
        fs = []
        for kind, arg in parts:
            if kind == "sleep":
                fs.append(("sleep", arg, None))
            elif kind == "conc":  # async all_reduce(arg[0]) concurrently with a2a(arg[1])
                x = torch.ones(arg[0] // 4)
                g = a2a(arg[1])
                fs.append(("conc", arg, (x, g)))
            else:
                fs.append((kind, arg, OPS[kind](arg)))
        dist.barrier()
        s0, k0 = snmp(), int(txf.read_text())
        per = []
        for it in range(iters + 2):
            ts = []
            t_start = time.perf_counter()
            for kind, arg, f in fs:
                t0 = time.perf_counter()
                if kind == "sleep":
                    time.sleep(arg)
                elif kind == "conc":
                    x, g = f
                    w = dist.all_reduce(x, async_op=True)
                    g()
                    w.wait()
                else:
                    f()
                ts.append(time.perf_counter() - t0)
            total = time.perf_counter() - t_start
            if it >= 2:
                per.append({"parts": ts, "total": total})
            time.sleep(gap_after)
        k1, s1 = int(txf.read_text()), snmp()
        rows.append({"kind": "seq", "name": name, "parts": [[k, a] for k, a, _ in fs], "iters": per,
                     "gap_after_ms": gap_after * 1000, "kernel_tx": k1 - k0, "snmp": sdiff(s0, s1)})

    stock = [("a2a", 40_000), ("a2a", 213_000), ("sleep", 0.005), ("a2a", 213_000), ("allreduce", 110_000)]
    seq("stock", stock)
    seq("stock_gap0", stock, gap_after=0.0)
    seq("stock_conc", [("a2a", 40_000), ("a2a", 213_000), ("sleep", 0.005), ("conc", (110_000, 213_000))])
    seq("herald", [("a2a", 37_000), ("a2a", 19_000), ("sleep", 0.005), ("allreduce", 37_000),
                   ("allreduce", 37_000)])
    Path(out).write_text(json.dumps({"rank": rank, "rate": rate, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def tc_stats() -> dict:
    res = {}
    for r in range(2):
        for dev, ns in ((f"herald_v{r}", None), (f"eth{r}", f"herald_ns{r}")):
            pre = ["ip", "netns", "exec", ns] if ns else []
            try:
                j = json.loads(subprocess.run(pre + ["tc", "-s", "-j", "qdisc", "show", "dev", dev],
                                              capture_output=True, text=True).stdout)
                res[dev] = {k: j[0].get(k) for k in ("bytes", "packets", "drops", "overlimits", "requeues")}
            except Exception as e:  # noqa: BLE001
                res[dev] = str(e)
    return res


def medians(raw: dict) -> list:
    """Per rate, collective, payload, gap and mode: the median over repetitions of the two ranks' mean time, and
    the efficiency it gives (payload × 8 / time / rate); per sequence, its median total and parts."""
    rows = []
    for run in raw["runs"]:
        r0, r1 = (x["rows"] for x in run["ranks"])
        for a, b in zip(r0, r1):
            if a["kind"] == "single":
                t = statistics.median((x + y) / 2 for x, y in zip(a["times"], b["times"]))
                rows.append({"rate": run["rate"], "op": a["op"], "payload": a["payload"], "gap_ms": a["gap_ms"],
                             "mode": a["mode"], "median_ms": 1e3 * t,
                             "eff": a["payload"] * 8 / t / (run["rate"] * 1e6),
                             "retrans": a["snmp"]["TcpRetransSegs"] + b["snmp"]["TcpRetransSegs"]})
            else:
                its = list(zip(a["iters"], b["iters"]))
                rows.append({"rate": run["rate"], "sequence": a["name"], "parts": a["parts"],
                             "median_total_ms": 1e3 * statistics.median((x["total"] + y["total"]) / 2 for x, y in its),
                             "median_parts_ms": [1e3 * statistics.median((x["parts"][i] + y["parts"][i]) / 2
                                                                         for x, y in its)
                                                 for i in range(len(a["parts"]))]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", type=int, nargs="+", default=[400, 200, 50, 25])
    ap.add_argument("--tag", default="base")
    ap.add_argument("--sysctl", nargs="*", default=[])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rate", type=int)
    ap.add_argument("--out", default=str(HERE / "results" / "link_efficiency"))
    ap.add_argument("--summarize", help="a raw_<tag>.json[.gz]: write its medians beside it and stop")
    a = ap.parse_args()
    if a.summarize:
        import gzip

        path = Path(a.summarize)
        raw = json.loads((gzip.open(path) if path.suffix == ".gz" else open(path)).read())
        out = path.with_name(path.name.replace("raw_", "medians_").replace(".gz", ""))
        out.write_text(json.dumps(medians(raw), indent=1))
        print(out)
        return
    if a.worker:
        worker(a.rate, a.out, a.quick)
        return
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"tag": a.tag, "sysctl": a.sysctl, "runs": []}
    setup(2)
    try:
        for r in range(2):
            for s in a.sysctl:
                subprocess.run(["ip", "netns", "exec", f"herald_ns{r}", "sysctl", "-w", s], check=True,
                               capture_output=True)
        cc = subprocess.run(["ip", "netns", "exec", "herald_ns0", "sysctl", "net.ipv4.tcp_congestion_control",
                             "net.ipv4.tcp_slow_start_after_idle"], capture_output=True, text=True).stdout
        result["ns_sysctl"] = cc
        print(cc, flush=True)
        for i, rate in enumerate(a.rates):
            limit(2, rate)
            t0 = time.time()
            run_in_namespaces(2, 29600 + (os.getpid() % 200) + i, lambda r: [
                __file__, "--worker", "--rate", str(rate), "--out", str(OUT / f"w_{a.tag}_{rate}_{r}.json")]
                + (["--quick"] if a.quick else []), f"rate {rate}", timeout=880)
            ranks = [json.loads((OUT / f"w_{a.tag}_{rate}_{r}.json").read_text()) for r in range(2)]
            result["runs"].append({"rate": rate, "tc": tc_stats(), "ranks": ranks, "wall_s": time.time() - t0})
            print(f"rate {rate}: {time.time() - t0:.0f} s", flush=True)
            (OUT / f"raw_{a.tag}.json").write_text(json.dumps(result))
        (OUT / f"medians_{a.tag}.json").write_text(json.dumps(medians(result), indent=1))
    finally:
        teardown(2)


if __name__ == "__main__":
    main()
