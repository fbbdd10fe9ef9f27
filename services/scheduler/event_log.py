"""The calls a placement Policy receives, recorded as events (JSON lines).

``EventRecorder(policy, path)`` wraps a policy (same interface, every call delegated)
and records each call with a snapshot of what the policy reads: the requests' field
values, the worker states (id, capacity, health, running request keys in order), ``now``,
the step quotas given, and for ``add_step`` the LengthModel state the caller set (its
parameters, and every prompt's history that changed since the last ``add_step``);
``schedule`` events also carry the decisions the policy returned, ``cancel_step`` events
the request keys it removed. Events go to a JSON-lines file (appended; each recorder run
starts with a ``start`` event) and/or stay in memory. The live scheduler records with it
(``RHYMERL_SCHEDULER_RECORD_EVENTS``); services/scheduler/simulator/replay.py replays.

Not recorded: ``num_queued()`` (a query that changes nothing).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Policy, Request, StepQuota, WorkerState

log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: requests are named by their (step, prompt, sample) key; schedule() quotas
REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(Request) if f.init)
CALLER_FIELDS = ("aborted",)  # Request fields the caller (not the policy) writes after add_step

Event = dict[str, Any]
Decision = dict[str, Any]


# --- snapshots ------------------------------------------------------------------------
def request_fields(request: Request) -> dict[str, Any]:
    return {name: getattr(request, name) for name in REQUEST_FIELDS}


def worker_fields(worker: WorkerState) -> dict[str, Any]:
    return {"worker_id": worker.worker_id, "capacity": worker.capacity, "healthy": worker.healthy,
            "running": [list(key) for key in worker.running]}


def assignment_fields(assignment: Assignment) -> Decision:
    return {"request": list(assignment.request.key), "worker_id": assignment.worker_id,
            "max_new_tokens": assignment.max_new_tokens, "is_migration": assignment.is_migration}


def policy_config(policy: Policy) -> dict[str, Any]:
    """The policy's constructor arguments that it keeps as attributes (JSON values)."""
    config: dict[str, Any] = {}
    for name in inspect.signature(type(policy)).parameters:
        value = getattr(policy, name, None)
        if isinstance(value, CostCurve):
            config[name] = {"num_tokens": list(value.num_tokens), "ms": list(value.ms)}
        elif isinstance(value, (bool, int, float, str)):
            config[name] = value
    return config


class _LengthsSnapshots:
    """Per LengthModel object: which history the recording already holds."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._models: list[LengthModel] = []  # kept alive so their ids stay unique
        self._seen: list[dict[str, list]] = []

    def snapshot(self, lengths: LengthModel) -> dict[str, Any]:
        # Reads LengthModel's private state: the history is what the caller loaded
        # (load_history), the only state of it a policy does not write itself.
        index = self._index.get(id(lengths))
        out: dict[str, Any] = {}
        if index is None:
            index = self._index[id(lengths)] = len(self._models)
            self._models.append(lengths)
            self._seen.append({})
            out["params"] = {"prior": lengths.prior, "recency": lengths.recency,
                             "sibling_weight": lengths.sibling_weight}
            out["siblings"] = [[step, prompt, list(found)] for (step, prompt), found in lengths._siblings.items()]
            out["progress"] = [[step, prompt, tokens] for (step, prompt), tokens in lengths._progress.items()]
            out["finished"] = [lengths.num_finished, lengths.num_capped]
        seen, raw = self._seen[index], lengths._raw
        history: dict[str, list | None] = {}
        for prompt_id, pairs in raw.items():
            old = seen.get(prompt_id)
            if old is not pairs and old != pairs:
                history[prompt_id] = [list(p) for p in pairs]
            seen[prompt_id] = pairs
        for prompt_id in [p for p in seen if p not in raw]:
            del seen[prompt_id]
            history[prompt_id] = None
        out["model"], out["history"] = index, history
        return out


# --- recording ------------------------------------------------------------------------
class EventRecorder(Policy):
    """A Policy that delegates to ``policy`` and records every call.

    Args:
        policy: the policy that decides.
        path: JSON-lines file the events are appended to (line-buffered); None: none.
        keep: also keep the events in ``self.events``.
    """

    def __init__(self, policy: Policy, path: str | Path | None = None, keep: bool = True) -> None:
        self.policy = policy
        self.name = policy.name
        self.events: list[Event] = []
        self._keep = keep
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._lengths = _LengthsSnapshots()
        self._emit({"op": "start", "format": FORMAT_VERSION, "policy": policy.name, "config": policy_config(policy)})

    def __getattr__(self, name: str) -> Any:  # anything else (chunk_size, cost, ...) is the policy's
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    def _emit(self, event: Event) -> None:
        if self._keep:
            self.events.append(event)
        if self._file is not None:
            try:
                self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
            except OSError as exc:  # a full disk must not stop the scheduler: stop recording
                log.warning("stopped recording scheduling events: %s", exc)
                self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def decisions(self) -> list[Decision]:
        return decisions_of(self.events)

    # --- the Policy interface -----------------------------------------------------
    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        # the core's sliced handover reaches this through Policy.add_step_in_slices: one
        # slice, recorded and replayed whole (a policy's slices equal its whole add_step)
        self._emit({"op": "add_step", "now": now, "requests": [request_fields(r) for r in requests],
                    "lengths": self._lengths.snapshot(lengths)})
        self.policy.add_step(requests, lengths, now)

    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        event = {"op": "schedule", "now": now, "workers": [worker_fields(w) for w in workers],
                 "quota": quota.as_dict() if quota is not None else None}
        assignments = self.policy.schedule(workers, now, quota)
        event["decisions"] = [assignment_fields(a) for a in assignments]
        self._emit(event)
        return assignments

    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        self._emit({"op": "on_chunk_done", "now": now, "request": request_fields(request), "worker_id": worker_id,
                    "num_new_tokens": num_new_tokens, "finished": finished})
        self.policy.on_chunk_done(request, worker_id, num_new_tokens, finished, now)

    def on_worker_lost(self, worker_id: str, requests: list[Request], now: float) -> None:
        self._emit({"op": "on_worker_lost", "now": now, "worker_id": worker_id,
                    "requests": [request_fields(r) for r in requests]})
        self.policy.on_worker_lost(worker_id, requests, now)

    def cancel_step(self, step_id: str) -> list[Request]:
        removed = self.policy.cancel_step(step_id)
        self._emit({"op": "cancel_step", "step_id": step_id, "removed": [list(r.key) for r in removed]})
        return removed

    def num_queued(self) -> int:
        return self.policy.num_queued()


def read_events(path: str | Path, run: int = -1) -> list[Event]:
    """The events of one recorder run in a JSON-lines file (default: the last one)."""
    runs: list[list[Event]] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            event = json.loads(line)
            if event["op"] == "start" or not runs:
                runs.append([])
            runs[-1].append(event)
    if not runs:
        raise ValueError(f"{path}: no events")
    return runs[run]


def write_events(events: Iterable[Event], path: str | Path) -> None:
    with open(path, "w") as f:
        for event in events:
            f.write(json.dumps(event, separators=(",", ":")) + "\n")


def decisions_of(events: Iterable[Event]) -> list[Decision]:
    """What the policy decided, in order: one entry per schedule and cancel_step call."""
    out = []
    for i, event in enumerate(events):
        if event["op"] == "schedule":
            out.append({"event": i, "op": "schedule", "now": event["now"], "assignments": event["decisions"]})
        elif event["op"] == "cancel_step":
            out.append({"event": i, "op": "cancel_step", "removed": event["removed"]})
    return out


