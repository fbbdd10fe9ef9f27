"""A discrete-event simulator of a rollout fleet that drives the live scheduler's policies."""

from services.scheduler.simulator.loop import RunResult, Simulator
from services.scheduler.simulator.worker import SimWorker, SpecConfig, SpeedCurve
from services.scheduler.simulator.workload import SimStep, Workload, synthetic_workload, trace_workload

__all__ = ["RunResult", "SimStep", "SimWorker", "Simulator", "SpecConfig", "SpeedCurve", "Workload",
           "synthetic_workload", "trace_workload"]
