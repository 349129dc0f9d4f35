"""The herald pipeline's seams: its batch stages and its scheduling strategies are registries, so a new
stage or planning mode is one new module with one registration (a decorator), found by name. Shown here
with modules written to a temporary folder added to the packages' search path: a strategy that counts
what it schedules (a ``gathered`` subclass) and a stage that counts the batches it sees, trained at 2
ranks beside the built-in strategy with identical losses."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import torch

from torchrec_herald.dist_utils import run_multiprocess

STRATEGY = '''
from torchrec_herald.pipeline.strategies import register_strategy
from torchrec_herald.pipeline.strategies.gathered import GatheredStrategy

SEEN = []


@register_strategy
class CountingStrategy(GatheredStrategy):
    name = "counting"

    def allocate(self, ctx):
        SEEN.append(ctx.index)
        super().allocate(ctx)
'''
STAGE = '''
from torchrec_herald.pipeline.stages import register_stage

SEEN = []


@register_stage("count_batches", 35)
def count_batches(host, ctx):
    SEEN.append(ctx.batch.labels.numel())
'''


def _plugins(root: Path) -> None:
    """Put ``counting.py`` beside the built-in strategies and ``count_batches.py`` beside the stages."""
    import torchrec_herald.pipeline.stages as stages
    import torchrec_herald.pipeline.strategies as strategies

    for package, name, code in ((strategies, "counting", STRATEGY), (stages, "count_batches", STAGE)):
        folder = root / package.__name__.rsplit(".", 1)[1]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.py").write_text(textwrap.dedent(code))
        if str(folder) not in package.__path__:
            package.__path__.append(str(folder))
    stages._DISCOVERED = False  # look for stage modules again


def _train(rank: int, world: int, root: str) -> Dict[str, Any]:
    from herald_harness import build, run_steps

    _plugins(Path(root))
    out: Dict[str, Any] = {}
    for planning in ("global", "counting"):
        b = build(world, dict(planner="herald", optimizer="sgd", via="apply", pooling="SUM", steps=6, batch_size=32))
        out[planning] = run_steps(b["dmp"], b["optimizer"], b["data"].train_batches(rank, world, b["batch_size"]),
                                  dict(window=2, planning=planning))
    from torchrec_herald.pipeline.stages import batch_stages

    out["stages"] = [name for name, _ in batch_stages()]
    out["strategy_saw"] = list(sys.modules["torchrec_herald.pipeline.strategies.counting"].SEEN)
    out["stage_saw"] = list(sys.modules["torchrec_herald.pipeline.stages.count_batches"].SEEN)
    return out


def test_the_built_in_stages_and_strategies_are_registered_in_order() -> None:
    from torchrec_herald.pipeline.options import HeraldPipelineConfig
    from torchrec_herald.pipeline.stages import batch_stages
    from torchrec_herald.pipeline.strategies import STRATEGIES, build_strategy, strategy_name, strategy_exists

    assert [name for name, _ in batch_stages()][:4] == ["keys", "allocate", "skip_inputs", "reads"]
    for name in ("global_batches", "gathered", "by_home"):
        assert strategy_exists(name)
    resolved = {strategy_name(HeraldPipelineConfig(**kw).resolve(whole, 2)[0]) for kw, whole in (
        ({}, True), ({}, False), ({"planning": "by_home", "allocator": "identity"}, False))}
    assert resolved == {"global_batches", "gathered", "by_home"}
    for name in resolved:  # imported on first use, by name
        assert type(build_strategy(name, None, None)).name == name  # type: ignore[arg-type]
    assert set(STRATEGIES) >= resolved
    assert not strategy_exists("nope") and not strategy_exists("../x")
    try:
        build_strategy("nope", None, None)  # type: ignore[arg-type]
    except ValueError as e:
        assert str(e).startswith("unknown scheduling strategy 'nope'; registered: [")
    else:
        raise AssertionError("an unknown strategy was built")


def test_a_new_strategy_and_a_new_stage_are_one_module_each(tmp_path: Path) -> None:
    res = run_multiprocess(_train, 2, str(tmp_path))
    for r in res:
        assert r["stages"] == ["keys", "allocate", "skip_inputs", "count_batches", "reads"]
        assert r["strategy_saw"] == list(range(6))  # every batch entering the window, once, in order
        assert len(r["stage_saw"]) == 12 and set(r["stage_saw"]) == {32}  # both runs' batches
    assert res[0]["counting"] == res[0]["global"] and res[1]["counting"] == res[1]["global"]
    assert torch.tensor(res[0]["global"]).isfinite().all()
