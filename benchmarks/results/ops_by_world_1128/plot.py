import json, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open("benchmarks/results/ops_by_world_1128/ops_by_world.json"))
fig, ax = plt.subplots(figsize=(6.4, 4))
style = {("herald_full", "before"): ("herald full, before (928f00f)", "tab:red", "--", "o"),
         ("herald_full", "after"): ("herald full, one-op reduce and store", "tab:orange", "-", "o"),
         ("herald_full", "grouped"): ("herald full, + keys grouped by kind, compiled", "tab:pink", "-", "o"),
         ("herald_full", "now"): ("herald full, now (+ one update across kinds)", "tab:red", "-", "o"),
         ("herald_hot", "after"): ("hot replication, now", "tab:blue", "-", "s"),
         ("stock", "after"): ("stock TABLE_WISE", "black", "-", "^")}
for key, (label, c, ls, m) in style.items():
    pts = sorted((r["world_size"], r["ops_per_step"]) for r in d["runs"] if (r["config"], r["code"]) == key)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=c, marker=m, label=label)
ax.set_xscale("log", base=2); ax.set_xticks([2, 4, 8, 16]); ax.set_xticklabels(["2", "4", "8", "16"])
ax.set_xlabel("ranks (W)"); ax.set_ylabel("ops a step, rank 0's training thread")
ax.set_title("Ops a step on a GPU's code path (CPU count, B=256)")
ax.set_ylim(0, None); ax.grid(alpha=.3); ax.legend(loc="upper left", fontsize=8)
fig.tight_layout(); fig.savefig("benchmarks/results/ops_by_world_1128/ops_by_world.png", dpi=120)
