"""Capture steps, one a file, switched on by name in the config and run in order by the pipeline."""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from ..host.dump_fifos import ExceptionFifos
from ..host.proc_exits import ProcExits
from .base import Step, StepFailed, StepNotApplicable
from .children import ChildrenStep
from .cuda_dump import CudaDumpStep
from .exits import ExitsStep
from .flight_recorder import FlightRecorderStep
from .introspect import IntrospectStep
from .nccl_ras import NcclRasStep
from .nvml import NvmlStep
from .pipeline import capture_all, run_steps
from .proc import ProcStep
from .progress import ProgressStep
from .pyspy import PySpyStep


def make_steps(config: Config, exits: ProcExits | None = None, fifos: ExceptionFifos | None = None) -> list[tuple[Step, float]]:
    """The configured steps with their timeouts: cheapest and least destructive first, the GPU dump last.
    ``exits``: the daemon's listener for process exits, which the exits step reads; ``fifos``: the
    daemon's exception FIFOs, through which the GPU dump comes where the process's driver writes there."""
    factories: dict[str, Callable[[], tuple[Step, float]]] = {
        "proc": lambda: (ProcStep(node=config.node), 5.0),
        "progress": lambda: (ProgressStep(), 5.0),
        "pyspy": lambda: (PySpyStep(native=config.pyspy_native, locals=True), config.pyspy_timeout),
        "children": lambda: (ChildrenStep(native=config.pyspy_native, node=config.node), config.pyspy_timeout),
        "exits": lambda: (ExitsStep(listener=exits, window=config.exit_window), 2.0),
        "introspect": lambda: (IntrospectStep(), config.introspect_timeout),
        "nvml": lambda: (NvmlStep(), config.nvml_timeout),
        "nccl_ras": lambda: (NcclRasStep(), config.nccl_ras_timeout),
        "flight_recorder": lambda: (FlightRecorderStep(), config.flight_recorder_timeout),
        "cuda_dump": lambda: (CudaDumpStep(config.driver_logs, config.discover_devices, fifos), config.gpu_dump_timeout),
    }
    names = [n for n in config.capture_steps if n != "cuda_dump"]
    if "cuda_dump" in config.capture_steps:
        names.append("cuda_dump")  # a GPU dump ends the process: nothing can come after it
    return [factories[name]() for name in names]


SLOW_STEPS = ("proc", "pyspy", "nvml")  # a slow job's capture: stacks and NVML only, never a pause, a dump or a trace


def slow_steps(config: Config) -> list[tuple[Step, float]]:
    """The steps of a slow job's capture (its ranks are not hung: nothing that pauses or ends them):
    /proc facts, plain non-blocking stacks with their local variables, NVML; of those the config runs."""
    out: list[tuple[Step, float]] = []
    for name in SLOW_STEPS:
        if name not in config.capture_steps:
            continue
        if name == "proc":
            out.append((ProcStep(node=config.node), 5.0))
        elif name == "pyspy":
            out.append((PySpyStep(native=False, locals=True, nonblocking=True), config.pyspy_timeout))
        else:
            out.append((NvmlStep(), config.nvml_timeout))
    return out


def capture_budget(config: Config) -> float:
    """Seconds from a hang's declaration to its capture's one deadline: ``capture_timeout`` for the
    gentle steps, plus ``gpu_dump_timeout`` kept for the GPU dump where one may be taken (the
    pipeline holds that much back from the gentle steps)."""
    dump = "cuda_dump" in config.capture_steps and config.gpu_dump != "never"
    return config.capture_timeout + (config.gpu_dump_timeout if dump else 0.0)


__all__ = ["Step", "StepFailed", "StepNotApplicable", "capture_all", "capture_budget", "make_steps", "run_steps", "slow_steps"]
