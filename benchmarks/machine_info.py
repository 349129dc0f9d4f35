"""Which machine a benchmark figure came from (written into every results JSON)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any, Dict

import torch


def machine() -> Dict[str, Any]:
    """CPU model and cores, GPU name and driver (if any), torch / fbgemm / torchrec versions."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: Dict[str, Any] = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version()}
    for mod in ("fbgemm_gpu", "torchrec"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # a version is informative only
            info[mod] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    else:
        info["gpu"] = None
    return info
