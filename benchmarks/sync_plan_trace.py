"""Trace model of Herald's sync plan on the default data (W=4, B=256, 30 global batches): embedding
vectors per step of eager vs lazy plans (owner / direct routes, LRU / Belady caches) and the exact
floor, as a share of stock all-TABLE_WISE. ``--check`` also replays every plan through the exactness
checker. Usage: .venv/bin/python benchmarks/sync_plan_trace.py [--check]
"""
import time, torch, sys
from torchrec_herald.data import SyntheticCriteo
from torchrec_herald.model import build_tables
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector
from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.testing.reference_plans import EagerSyncPlanner, LazySyncPlanner, simulate
W, B, T = 4, 256, 30; G = W * B
data = SyntheticCriteo(scale=0.01, seed=0, zipf_alpha=1.22)
tables = build_tables(data.feature_names, data.num_embeddings, 16, "SUM")
names = [t.name for t in tables]
# hot sets as in tests/test_herald_planner.py (stats from the first 20 global batches)
sample = [b.sparse_features for _, b in zip(range(20), data.train_batches(0, 1, G))]
stats = AccessStats.from_batches(sample, tables)
choice = CostModelHotSetSelector().select(stats, tables, W, B, 67108864)
hot = {n: c.hot_ids for n, c in choice.items()}
trace = []
for i in range(T):
    _, ids, _, _ = data.global_batch("train", i, G)
    trace.append({n: [ids[f, r * B:(r + 1) * B] for r in range(W)] for f, n in enumerate(names)})
stock = 2 * G * len(names) * (W - 1) / W
loc_cm = Locality.from_tables(tables, W, hot)
loc_all = Locality.from_tables(tables, W, {t.name: torch.arange(t.num_embeddings) for t in tables})
print("hot rows", sum(h.numel() for h in hot.values()), "of", sum(data.num_embeddings), "stock TW vectors/step", stock)
def run(label, p):
    t0 = time.time(); r = simulate(trace, p, check="--check" in sys.argv)
    c = r.total
    print(f"{label:<48} {r.vectors_per_step:9.0f} vec/step {100*r.vectors_per_step/stock:6.1f} %  "
          f"mp {c.miss_pull/T:7.0f} up {c.update_pull/T:7.0f} ush {c.update_push/T:6.0f} msh {c.miss_push/T:6.0f} "
          f"red {c.reduce/T:6.0f} dlv {c.deliver/T:6.0f} hit {c.hit_rate:.3f} cache_hit {c.cache_hit_rate:.3f} ({time.time()-t0:.1f}s)")
run("eager, cost-model hot set, no cache", EagerSyncPlanner(loc_cm))
for route in ("owner", "direct"):
    for f in (0.01, 0.05, 0.2):
        for pol in ("lru", "belady"):
            run(f"lazy {route} K=5 cap {f} {pol}, cost-model hot", LazySyncPlanner(loc_cm, f, pol, 5, route))
run("eager, all rows replicated", EagerSyncPlanner(loc_all))
for route in ("owner", "direct"):
    run(f"lazy {route} K=5, all rows replicated (floor)", LazySyncPlanner(loc_all, 0.01, "lru", 5, route))
# extra: docs/design.md's floor formula, herald sparse hot sync, K effect, steady state (steps 5..29)
from torchrec_herald.testing.reference_plans import _normalize, _readers
floor = 0; sparse_hot = 0
for st in trace:
    nm = _normalize(st, loc_all)
    for n in names:
        hs = set(hot[n].tolist())
        for x, S in _readers(nm[n]).items():
            floor += 2 * (len(S) - 1)
            if x in hs: sparse_hot += len(S) * (W - 1)
print(f"exact floor (docs/design.md §3) sum 2(|S|-1): {floor/T:.0f} vec/step {100*floor/T/stock:.1f} %; herald sparse hot sync |S|(W-1): {sparse_hot/T:.0f}")
for label, p in [("eager cm", EagerSyncPlanner(loc_cm)), ("lazy owner 0.05 lru K5", LazySyncPlanner(loc_cm, 0.05)),
                 ("lazy direct 0.2 belady K5", LazySyncPlanner(loc_cm, 0.2, "belady", 5, "direct")),
                 ("lazy direct 0.2 belady K1", LazySyncPlanner(loc_cm, 0.2, "belady", 1, "direct")),
                 ("lazy direct 0.2 lru K1", LazySyncPlanner(loc_cm, 0.2, "lru", 1, "direct")),
                 ("floor direct K5", LazySyncPlanner(loc_all, 0.01, "lru", 5, "direct")),
                 ("floor direct K1", LazySyncPlanner(loc_all, 0.01, "lru", 1, "direct"))]:
    r = simulate(trace, p); v = sum(c.vectors for c in r.per_step[5:]) / (T - 5)
    print(f"{label:<28} all {100*r.vectors_per_step/stock:5.1f} %  steady(5..29) {100*v/stock:5.1f} %")
