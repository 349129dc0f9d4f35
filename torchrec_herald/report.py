"""What a run leaves for a person to look at: headline metrics with keys that say their scope and unit,
and, for a ``compare_with`` run, ``comparison.md`` / ``comparison.json`` / ``comparison.png`` putting the
baseline and herald side by side (loss curves, embedding bytes by kind with the dense all-reduce apart,
samples/s), so the embedding saving, the product's point, shows at a glance.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["TRAFFIC_GROUPS", "data_samples_per_s", "embedding_bytes_per_step", "format_comparison_table",
           "format_metrics_table", "headline", "last_steps_window", "loss_gap", "plan_summary", "plot_training",
           "priced_link", "strict_json", "traffic_groups", "write_comparison"]

#: TrafficMeter tags of the traffic that is not embedding traffic (everything else, TorchRec's own
#: untagged all-to-alls included, is)
TRAFFIC_GROUPS: Dict[str, Tuple[str, ...]] = {
    "dense all-reduce": ("dense_allreduce",),
    "scheduling": ("herald_schedule_meta", "herald_samples", "herald_meta", "herald_skip_meta"),
}


def strict_json(data: Any) -> str:
    """``data`` as strict JSON (indented): a NaN or infinite figure (an eval split with no batch) becomes null,
    where ``json.dumps`` writes ``NaN``, which strict readers refuse."""
    def finite(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(data), indent=2)


def loss_gap(losses: Dict[str, List[float]]) -> str:
    """How far the runs' per-step losses are apart, in words: the largest gap of the last run from the first and
    its step, or that they are identical, or their lengths where they differ (input skipping trains fewer steps an
    epoch). The figure's title and a row of the comparison table say it, rather than assert it."""
    runs = [xs for xs in losses.values() if xs]
    if len(runs) < 2:
        return ""
    first, last = runs[0], runs[-1]
    if len(first) != len(last):
        return f"runs of {len(first)} and {len(last)} steps"
    gaps = [abs(a - b) for a, b in zip(first, last)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[worst] == 0:
        return f"identical over {len(gaps)} steps"
    return f"largest gap {gaps[worst]:.1e} (step {worst + 1} of {len(gaps)})"


def data_samples_per_s(m: Dict[str, Any]) -> float:
    """The data's samples read per second: what an epoch's time follows. Input skipping reads more than it trains
    (``approximate.data_samples_per_s``); every other run reads what it trains (``samples_per_s``)."""
    return float((m.get("approximate") or {}).get("data_samples_per_s") or m["samples_per_s"])


def traffic_groups(m: Dict[str, Any]) -> Dict[str, float]:
    """Bytes per step (all ranks) of a run's metrics in four parts that add up to its total:
    ``embedding vectors`` (pooled vectors, their gradients, hot-row and plan rows, as the comparison
    table's "embedding KiB"), ``ids and lengths`` (the rest of the embedding collectives' bytes),
    ``scheduling`` (herald's allocator and plan metadata, sample moves) and ``dense all-reduce``."""
    tags = {t: s["bytes"] for t, s in m.get("traffic_per_step_by_tag", {}).items()}
    total = m["traffic_per_step_total"]["bytes"]
    dense = sum(tags.get(t, 0.0) for t in TRAFFIC_GROUPS["dense all-reduce"])
    sched = sum(tags.get(t, 0.0) for t in TRAFFIC_GROUPS["scheduling"])
    vectors = embedding_bytes_per_step(m)
    return {"embedding vectors": vectors, "ids and lengths": max(total - dense - sched - vectors, 0.0),
            "scheduling": sched, "dense all-reduce": dense}


def headline(m: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The headline figures of a run under keys that say scope and unit (``metrics.json`` → ``summary``).

    ``embedding_vectors_per_step_all_ranks``: TrafficMeter's count of embedding rows on the wire (a row moved with
    its Adagrad state float counts 1; the state's bytes are in ``embedding_bytes_per_step_all_ranks``); not the
    same as ``herald_pipeline.plan_transfers_per_step_all_ranks``, the rows the plan moves.
    ``data_samples_per_s_all_ranks``: :func:`data_samples_per_s` (input skipping reads more samples than it trains)."""
    g = traffic_groups(m)
    steps = max(int(m["steps"]), 1)
    return {
        "bytes_per_step_all_ranks": m["traffic_per_step_total"]["bytes"],
        "embedding_bytes_per_step_all_ranks": g["embedding vectors"],
        "ids_and_lengths_bytes_per_step_all_ranks": g["ids and lengths"],
        "dense_allreduce_bytes_per_step_all_ranks": g["dense all-reduce"],
        "scheduling_bytes_per_step_all_ranks": g["scheduling"],
        "embedding_vectors_per_step_all_ranks": m["traffic_per_step_total"]["embedding_vectors"],
        "collective_calls_per_step_per_rank": m["traffic_per_step_total"]["calls"] / max(int(m["world_size"]), 1),
        "samples_per_s_all_ranks": m["samples_per_s"],
        "data_samples_per_s_all_ranks": data_samples_per_s(m),
        "step_time_ms_p50": 1e3 * m["step_time_s"].get("p50", float("nan")),
        **{f"step_{k}_ms_mean": v for k, v in m.get("step_time_breakdown_ms", {}).items()},
        "train_time_s": m["train_time_s"],
        "steps": float(steps),
        "eval_auc": m.get("eval", {}).get("auc"),  # (null without an eval pass: strict JSON)
        "eval_logloss": m.get("eval", {}).get("logloss"),
    }


def embedding_bytes_per_step(m: Dict[str, Any]) -> float:
    """Embedding bytes per step of a run's metrics: embedding vectors × dim × 4 (pooled vectors, their
    gradients, hot-row and DATA_PARALLEL-table gradient rows, rows moved by Herald's plan), plus the
    row-wise Adagrad state float that each row moved by the plan carries (``herald_pull`` /
    ``herald_update_push`` / ``herald_push_pull``)."""
    dim = m["config"]["model"]["embedding_dim"]
    tags = m.get("traffic_per_step_by_tag", {})
    moved = ("herald_pull", "herald_update_push", "herald_push_pull")
    state = sum(tags.get(t, {}).get("bytes", 0) for t in moved) / (dim + 1) \
        if m["config"]["optimizer"]["name"] == "rowwise_adagrad" else 0.0
    return m["traffic_per_step_total"]["embedding_vectors"] * dim * 4 + state


def _smooth(xs: Sequence[float], k: int) -> List[float]:
    return [sum(xs[max(0, i - k + 1): i + 1]) / len(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def _smoothing(runs: Sequence[Sequence[float]]) -> int:
    """The running mean's length for loss curves drawn together: one for every curve (the longest run's 50th), so the
    axis label holds for each."""
    return max(1, max(map(len, runs), default=0) // 50)


def _no_traffic(ax: Any, world_size: Any) -> None:
    """An empty traffic panel says why (one rank sends nothing) rather than draw an axis from -0.04 to 0.04."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"no traffic between ranks\n({world_size} rank)" if world_size == 1 else "no traffic between ranks",
            ha="center", va="center", fontsize=11, color="#555555", transform=ax.transAxes)


def plan_summary(plan: Mapping[str, str]) -> str:
    """A plan (table → sharding type) in one cell: how many tables each sharding type got (``26×table_wise``)."""
    return ", ".join(f"{v}×{k}" for k, v in sorted(Counter(plan.values()).items()))


def last_steps_window(steps: int) -> int:
    """How many last steps ``train_logloss`` averages (metrics.json): a fifth of the run, 1 to 50."""
    return max(1, min(50, int(steps) // 5))


def write_comparison(run_dir: Path, runs: Dict[str, Dict[str, Any]], losses: Dict[str, List[float]],
                     table_md: str) -> Dict[str, Path]:
    """``comparison.md`` (``table_md``), ``comparison.json`` (every run's :func:`headline`, traffic by
    category and the ratios last / first run) and ``comparison.png`` into ``run_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    heads = {n: headline(runs[n]) for n in names}
    base, new = names[0], names[-1]
    ratios = {k: heads[new][k] / heads[base][k] for k in heads[base] if isinstance(heads[base][k], float)
              and isinstance(heads[new].get(k), float)  # (a figure one run lacks: peer wait not measured)
              and heads[base][k] not in (0.0,) and heads[base][k] == heads[base][k]}
    data = {"runs": {n: {"summary": heads[n], "traffic_bytes_per_step_all_ranks": traffic_groups(runs[n])}
                     for n in names},
            "ratio_last_to_first": ratios, "baseline": base, "compared": new}
    paths = {"md": run_dir / "comparison.md", "json": run_dir / "comparison.json", "png": run_dir / "comparison.png"}
    paths["md"].write_text(table_md + "\n")
    paths["json"].write_text(strict_json(data))

    colors = {"embedding vectors": "#4c72b0", "ids and lengths": "#9db4d8", "scheduling": "#dd8452"}
    palette = ("#7f7f7f", "#c44e52", "#55a868", "#8172b2")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1.2, 1.6, 0.8]})
    a, b, c = axes
    k = _smoothing(list(losses.values()))
    for i, (n, color) in enumerate(zip(names, palette)):
        xs = losses.get(n, [])
        if xs:
            a.plot(range(1, len(xs) + 1), _smooth(xs, k), label=n, color=color, lw=4 if i == 0 else 1.2,
                   alpha=0.45 if i == 0 else 1.0)
    gap = loss_gap(losses)
    a.set(xlabel="step", ylabel=f"train logloss (mean over ranks, running mean of {k})",
          title=f"loss: {gap}" if gap else "loss")
    a.legend(fontsize=8)
    # traffic: one horizontal bar per run, its parts stacked; the dense all-reduce (the same in every
    # run) is written beside the bar, so the embedding saving stays visible
    y = list(range(len(names)))[::-1]
    moved = any(traffic_groups(runs[n])[part] for n in names for part in ("embedding vectors", "ids and lengths",
                                                                          "scheduling", "dense all-reduce"))
    for yi, n in zip(y if moved else [], names):
        g = traffic_groups(runs[n])
        left = 0.0
        for part in ("embedding vectors", "ids and lengths", "scheduling"):
            v = g[part] / 1024
            b.barh(yi, v, left=left, color=colors[part], label=part if yi == y[0] else None)
            if v >= 40:
                b.text(left + v / 2, yi, f"{v:.0f}", ha="center", va="center", color="white", fontsize=8)
            left += v
        b.text(left, yi, f"  +{g['dense all-reduce'] / 1024:.0f} KiB dense all-reduce", va="center", fontsize=7,
               color="#555555")
    e_base, e_new = heads[base]["embedding_bytes_per_step_all_ranks"], heads[new]["embedding_bytes_per_step_all_ranks"]
    if moved:
        b.set_yticks(y, names, fontsize=8)
        b.set(xlabel="KiB per step, all ranks")
        b.set_title(f"embedding vectors: {100 * (1 - e_new / e_base):.0f} % fewer bytes" if e_base > 0 else "traffic",
                    fontsize=11)
        b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)  # (below: clear
        # of the bars)
        b.set_xlim(0, max(sum(v for k, v in traffic_groups(runs[n]).items() if k != "dense all-reduce")
                          for n in names) / 1024 * 1.45)
    else:
        _no_traffic(b, runs[base].get("world_size"))
    read = any((runs[n].get("approximate") or {}).get("data_samples_per_s") for n in names)
    sps = [data_samples_per_s(runs[n]) for n in names]
    c.bar(range(len(names)), sps, color=list(palette[: len(names)]))
    for i, v in enumerate(sps):
        c.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    c.set_xticks(range(len(names)), [textwrap.fill(n.split(" (")[0], 16) for n in names], fontsize=8)
    c.set(ylabel="data samples read/s, all ranks (skipped ones too)" if read else "samples/s, all ranks")
    c.set_title(f"speed: {sps[-1] / sps[0]:.2f}×" if sps[0] else "speed", fontsize=11)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths


def plot_training(run_dir: Path, losses: List[float], metrics: Dict[str, Any]) -> None:
    """training.png: the loss curve and this run's traffic per step in the report's four parts
    (embedding vectors, ids and lengths, herald's scheduling, the dense all-reduce)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    k = _smoothing([losses])
    a.plot(range(1, len(losses) + 1), _smooth(losses, k))  # (the comparison figure's running mean)
    plan = plan_summary(metrics["plan"]) if metrics.get("plan") else ""
    a.set(xlabel="step", ylabel=f"train logloss (mean over ranks,\nrunning mean of {k})",
          title=f"loss: {plan}" if plan else "loss")
    parts = traffic_groups(metrics)
    names = list(parts)[::-1]
    if any(parts.values()):
        kib = [parts[n] / 1024 for n in names]
        b.barh(names, kib, color=["#d9d9d9", "#dd8452", "#9db4d8", "#4c72b0"])
        for y, v in enumerate(kib):
            b.text(v, y, f" {v:.0f}" if v >= 10 or v == 0 else f" {v:.2g}", va="center", fontsize=8)
        b.set(xlabel="KiB per step (all ranks, sent to other ranks)", title="traffic by kind")
    else:
        _no_traffic(b, metrics.get("world_size"))
    fig.tight_layout()
    fig.savefig(run_dir / "training.png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def breakdown_cell(m: Dict[str, Any]) -> str:
    b = m.get("step_time_breakdown_ms")
    if not b:
        return "–"
    unseen = " (NCCL's communication does not block the host: it is in compute)" if m.get("comm_wait_host_only") else ""
    over = f" over {m['peer_wait_steps']} steps" if m.get("peer_wait_steps") else ""
    peers = f", {b['peer_wait']:.1f} of it for late peers{over}" if b.get("peer_wait") is not None else ""
    return (f"{b['step']:.1f} = {b['compute']:.1f} + {b['comm_wait']:.1f}{peers} + {b['scheduler_critical']:.1f} "
            f"(ahead {b['scheduler_overlapped']:.1f}){unseen}")


def decision_cell(m: Dict[str, Any]) -> str:
    """What the model of time picked and why: each candidate's predicted ms per rank and step (link,
    collectives, herald's extra work), the link it priced, and the pick."""
    d = m.get("link_decision") or {}
    preds = d.get("predicted")
    if not preds:
        return "–"
    names = {"herald": "herald", "table_wise": "TW", "default": "default plan"}
    cands = ", ".join(f"{names.get(n, n)} {p['step_ms']:.1f}" for n, p in preds.items())
    if d.get("one_rank"):
        return f"{cands} -> {names.get(d.get('chosen'), d.get('chosen'))} (one rank: no link)"
    link, src = priced_link(d)
    why = "; the default plan set aside: within one collective's latency of TW" if d.get("note") else ""
    return f"{cands} -> {names.get(d.get('chosen'), d.get('chosen'))} ({src} link {link:,.0f} Mbit/s{why})"


def priced_link(d: Dict[str, Any]) -> Tuple[Optional[float], str]:
    """The link rate a decision priced and whether it was ``"measured"`` (the probe's) or ``"given"`` (declared)."""
    measured = (d.get("measured") or {}).get("link_mbit")
    link = d.get("link_mbit") if d.get("link_mbit") is not None else measured
    return link, "measured" if measured is not None and link == measured else "given"


def predicted_step_cell(m: Dict[str, Any]) -> str:
    """This run's compute plus the model's link part of the plan it trained, next to the measured step; its measured
    wait for late peers (the breakdown's ``peer_wait``), where measured, on the critical path as the model puts it."""
    d, b = m.get("link_decision") or {}, m.get("step_time_breakdown_ms")
    p = (d.get("predicted") or {}).get(d.get("chosen"))
    if not p or not b:
        return "–"
    if m.get("comm_wait_host_only"):  # (compute holds NCCL's communication: adding the model's would count it twice)
        return "– (NCCL's communication is in this run's compute on the host's clock)"
    from torchrec_herald.planner.time_model import step_ms

    peers = b.get("peer_wait")
    step = step_ms(b["compute"], p["extra_ms"], p["comm_ms"] + (peers or 0.0), p["link_busy_ms"])
    link, src = priced_link(d)
    measured = (d.get("measured") or {}).get("link_mbit")
    if src == "given" and link is not None and not d.get("one_rank"):  # (priced for a link the run did not train on)
        real = f", {measured:,.0f} Mbit/s measured" if measured is not None else ""
        return f"{step:.1f} on the given {link:,.0f} Mbit/s (measured {b['step']:.1f} on the real link{real})"
    with_peers = f", with {peers:.1f} measured for late peers" if peers is not None else ""
    return f"{step:.1f} (measured {b['step']:.1f}, {100 * (step / b['step'] - 1):+.0f} %{with_peers})"


def _fixed(digits: int) -> Any:
    return lambda v: f"{v:,.{digits}f}"


def format_comparison_table(runs: Dict[str, Dict[str, Any]], losses: Optional[Dict[str, List[float]]] = None) -> str:
    """Markdown table, one column per run (e.g. stock baseline vs herald) and a last/first ratio; with the runs'
    per-step ``losses``, a row saying how far apart they are (:func:`loss_gap`) and the train logloss of each over
    the same last steps (runs of different lengths, input skipping's, average the shorter run's window)."""
    names = list(runs)
    ms = [runs[n] for n in names]
    skipping = any((m.get("approximate") or {}).get("data_samples_per_s") for m in ms)
    gap = loss_gap(losses) if losses else ""
    curves = [losses.get(n) for n in names] if losses else []
    if curves and all(curves):
        window = min(last_steps_window(len(xs)) for xs in curves)
        last = [sum(xs[-window:]) / window for xs in curves]
    else:  # (each run's own figure, over its own window)
        last = [m["train_logloss"] for m in ms]
        windows = {last_steps_window(m["steps"]) for m in ms}
        window = windows.pop() if len(windows) == 1 else None
    over = f"the last {window} steps" if window else "the last fifth of each run, at most 50 steps"

    def emb_kib(m: Dict[str, Any]) -> float:
        return embedding_bytes_per_step(m) / 1024

    count, kib, rate, four = _fixed(0), _fixed(1), _fixed(0), (lambda v: f"{v:.4f}")
    rows = [
        ("plan", [plan_summary(m["plan"]) for m in ms], None, str),
        ("steps", [m["steps"] for m in ms], None, str),
        ("KiB sent per step (all ranks)", [m["traffic_per_step_total"]["bytes"] / 1024 for m in ms], "ratio", kib),
        ("embedding KiB per step", [emb_kib(m) for m in ms], "ratio", kib),
        ("embedding vectors per step", [m["traffic_per_step_total"]["embedding_vectors"] for m in ms], "ratio", count),
        ("samples/s", [m["samples_per_s"] for m in ms], "ratio", rate),
        *([("data samples read/s (skipped ones too: an epoch's time follows it)", [data_samples_per_s(m) for m in ms],
            "ratio", rate)] if skipping else []),
        ("step ms = compute + comm wait + scheduler (ahead: off the path)", [breakdown_cell(m) for m in ms], None, str),
        ("plan picked by the model of time (predicted ms per rank: link + collectives + herald's extra work)",
         [decision_cell(m) for m in ms], None, str),
        ("predicted step ms (this run's compute and wait for late peers + the model's link part)",
         [predicted_step_cell(m) for m in ms], None, str),
        (f"train logloss (mean of {over})", last, "diff", four),
        *([("per-step train logloss, last run vs first", [""] * len(ms), f"note:{gap}", str)] if gap else []),
        ("eval AUC", [m["eval"].get("auc") for m in ms], "diff", four),  # (None: not evaluated)
        ("eval logloss", [m["eval"].get("logloss") for m in ms], "diff", four),
    ]
    head = "| metric | " + " | ".join(names) + f" | {names[-1]} vs {names[0]} |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for label, vals, kind, fmt in rows:
        cells = ["–" if v is None else fmt(v) for v in vals]
        if kind and kind.startswith("note:"):  # (a row whose words belong in the comparison's column)
            cmp = kind[len("note:"):]
        elif kind == "ratio" and vals[0]:
            cmp = f"{vals[-1] / vals[0]:.3f}× ({100 * (vals[-1] / vals[0] - 1):+.1f} %)"
        elif kind == "diff" and vals[0] is not None and vals[-1] is not None:
            d = vals[-1] - vals[0]  # (a gap under the table's 4 decimals is shown, not rounded to +0.0000)
            cmp = f"{d:+.4f}" if d == 0 or abs(d) >= 5e-5 else f"{d:+.1e}"
        else:
            cmp = ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cmp} |")
    return "\n".join(lines)


def format_metrics_table(metrics: Dict[str, Any]) -> str:
    """Markdown table of the headline figures of one run."""
    ev = metrics.get("eval", {})
    tot = metrics["traffic_per_step_total"]
    rows = [
        ("ranks × local batch", f"{metrics['world_size']} × {metrics['local_batch_size']}"),
        ("plan", plan_summary(metrics["plan"]) if metrics.get("plan") else "–"),
        ("plan picked by the model of time (predicted ms per rank: link + collectives + herald's extra work)",
         decision_cell(metrics)),
        ("steps", metrics["steps"]),
        ("samples/s", f"{metrics['samples_per_s']:,.0f}"),
        ("step time p50 / p90 (ms)", f"{metrics['step_time_s']['p50'] * 1e3:.1f} / "
                                     f"{metrics['step_time_s']['p90'] * 1e3:.1f}"),
        ("step ms = compute + comm wait + scheduler (ahead: off the path)", breakdown_cell(metrics)),
        ("train logloss first → last", f"{metrics['train_logloss_first']:.4f} → {metrics['train_logloss']:.4f}"),
        ("eval AUC", f"{ev['auc']:.4f}" if ev.get("auc") is not None else "– (not evaluated)"),
        ("eval logloss", f"{ev['logloss']:.4f}" if ev.get("logloss") is not None else "– (not evaluated)"),
        ("KiB sent per step (all ranks)", f"{tot['bytes'] / 1024:.1f}"),
        ("embedding vectors per step", f"{tot['embedding_vectors']:,.0f}"),
    ]
    for kind, s in metrics["traffic_per_step"].items():
        rows.append((f"  {kind} KiB/step", f"{s['bytes'] / 1024:.1f}"))
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
