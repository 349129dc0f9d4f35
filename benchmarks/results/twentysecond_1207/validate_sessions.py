"""The model of time's validation on four sessions' runs (this session's twice: at 20871d4 and at 5be5be3), each with
its own inputs; now a name for ``benchmarks/validate_sessions.py`` (the tool), with this session's five sets:

    .venv/bin/python benchmarks/results/twentysecond_1207/validate_sessions.py eighteenth twentieth twentyfirst twentysecond twentysecond_final
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import validate_sessions  # noqa: E402

validate_sessions.main(sys.argv[1:] or ["eighteenth", "twentieth", "twentyfirst", "twentysecond", "twentysecond_final"])
