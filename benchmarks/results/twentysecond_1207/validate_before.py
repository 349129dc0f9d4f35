"""The same validation with the link term before 20871d4 (without the critical collectives' latencies):

    .venv/bin/python benchmarks/results/twentysecond_1207/validate_before.py
"""
import sys, runpy
sys.path[:0] = ["/work/main/benchmarks", "/work/main"]
from torchrec_herald.planner import time_model as T
orig = T.StepTimeModel.predict
def predict(self, load):  # the model before 20871d4: the link term without the critical collectives' latencies
    p = orig(self, load)
    busy = p.link_busy_ms - self.collectives(load.collectives)
    return T.StepPrediction(p.name, p.compute_ms, p.extra_ms, p.comm_ms, busy,
                            T.step_ms(p.compute_ms, p.extra_ms, p.comm_ms, busy, load.host_bound_ms))
T.StepTimeModel.predict = predict
sys.argv = ["x"] + sys.argv[1:]
runpy.run_path("/work/main/benchmarks/results/twentysecond_1207/validate_sessions.py", run_name="__main__")
