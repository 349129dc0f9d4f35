"""Is a repeat's second run slower? The twenty-third session's 30 repeats of identical plans (W=2, unlimited,
herald's fallback to TABLE_WISE beside TABLE_WISE), both orders, re-read with a standard error.

    python benchmarks/results/twentyfourth_1207/order_reanalysis.py

Within: each repeat's second run over its first. Across: a repeat's second run over the next repeat's first (the
runs follow each other with no pause, so a cost of the place would show in both pairings).
"""
import json
import math
import statistics
from pathlib import Path

R23 = Path(__file__).resolve().parent.parent / "twentythird_1207"
within, across = [], []
for name, first, second in [("order_h_first", "herald_defaults", "tw"), ("order_tw_first", "tw", "herald_defaults")]:
    rows = {r["config"]: r for r in json.loads((R23 / f"{name}.json").read_text())["rows"]}
    a = [x["step_ms"] for x in rows[first]["repeats_in_order"]]
    b = [x["step_ms"] for x in rows[second]["repeats_in_order"]]
    within += [math.log(b[i] / a[i]) for i in range(len(a))]
    across += [math.log(b[i] / a[i + 1]) for i in range(len(a) - 1)]
    h, t = rows["herald_defaults"]["repeats_in_order"], rows["tw"]["repeats_in_order"]
    g = math.exp(statistics.mean(math.log(p["step_ms"] / q["step_ms"]) for p, q in zip(h, t)))
    print(f"{name}: herald's step / TABLE_WISE's, geometric mean of {len(h)} repeats: {g:.3f}")
for label, v in [("within a repeat (second / first)", within), ("across repeats (second / next first)", across)]:
    m, se = statistics.mean(v), statistics.stdev(v) / math.sqrt(len(v))
    print(f"{label}: n={len(v)}, step ratio {math.exp(m):.3f}, standard error {se:.3f}, t={m / se:.2f}")
