"""Ready means warm: the warm-up an engine runs before it says it serves (warm_up.py) and the monitor that counts
kernel compiles and plan timings after that (compile_monitor.py). docs/gpu.md#ready-means-warm."""

from engine_core.readiness.compile_monitor import CompileMonitor
from engine_core.readiness.warm_up import WarmUpReport, runs_triton_interpreted, warm_up

__all__ = ["CompileMonitor", "WarmUpReport", "runs_triton_interpreted", "warm_up"]
