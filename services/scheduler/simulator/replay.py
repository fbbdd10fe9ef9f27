"""Record the calls a Policy receives and replay them on a fresh policy.

The live scheduler and the simulator drive the same Policy classes; this module makes
that checkable and debuggable offline:

  1. ``EventRecorder(policy, path)`` wraps a policy (same interface, every call
     delegated) and records each call with a snapshot of what the policy reads: the
     requests' field values, the worker states (id, capacity, health, running request
     keys in order), ``now``, the step quotas given, and for ``add_step`` the LengthModel state the caller set
     (its parameters, and every prompt's history that changed since the last
     ``add_step``); ``schedule`` events also carry the decisions the policy returned,
     ``cancel_step`` events the request keys it removed. Events go to a JSON-lines file
     (appended; each recorder run starts with a ``start`` event) and/or stay in memory.
  2. ``replay(events, policy)`` makes the same calls on a fresh policy: Request
     objects are rebuilt once per request key and keep their identity across calls
     (policies hold them), WorkerState objects once per worker_id; the LengthModel is
     rebuilt from the recorded state. It returns the fresh policy's decisions, which
     a deterministic policy makes identically to the recorded ones.

``python -m services.scheduler.simulator.replay EVENTS.jsonl --policy rhymerl`` replays a
recording (e.g. the live scheduler's, ``RHYMERL_SCHEDULER_RECORD_EVENTS``) and prints
whether the decisions match, and the first difference if not.

Not recorded: ``num_queued()`` (a query that changes nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel, _WeightedLengths
from services.scheduler.policies import make_policy, policy_options
from services.scheduler.policies.base import Assignment, Policy, Request, RequestKey, StepQuota, WorkerState

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


# --- reading and replaying ----------------------------------------------------------
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


def policy_from_events(events: list[Event], name: str | None = None, **overrides: Any) -> Policy:
    """A fresh policy configured like the recorded one (``name``: another kind, given the
    recorded settings it accepts)."""
    start = events[0] if events and events[0]["op"] == "start" else {"policy": "static", "config": {}}
    name = name or start["policy"]
    accepted = policy_options(name)
    kwargs = {k: v for k, v in start["config"].items() if k in accepted}
    if isinstance(kwargs.get("cost"), dict):
        kwargs["cost"] = CostCurve(tuple(kwargs["cost"]["num_tokens"]), tuple(kwargs["cost"]["ms"]))
    kwargs.update(overrides)
    return make_policy(name, **kwargs)


def _key(fields: dict[str, Any]) -> RequestKey:
    return RequestKey(fields["step_id"], fields["prompt_id"], fields["sample_index"])


class ReplayError(RuntimeError):
    """The replayed policy failed on a recorded call (it was fed events that another
    policy's decisions produced, or the recording is incomplete)."""


class _Replayer:
    def __init__(self, policy: Policy, mismatches: list[str] | None) -> None:
        self.policy = policy
        self.requests: dict[RequestKey, Request] = {}
        self.workers: dict[str, WorkerState] = {}
        self.models: list[LengthModel] = []
        self.mismatches = mismatches

    def request(self, fields: dict[str, Any], where: str) -> Request:
        key = _key(fields)
        request = self.requests.get(key)
        if request is None:
            request = self.requests[key] = Request(**fields)
            return request
        if self.mismatches is not None:
            diff = {k: (getattr(request, k), v) for k, v in fields.items()
                    if k not in CALLER_FIELDS and getattr(request, k) != v}
            if diff:
                self.mismatches.append(f"{where}: {request.key} (replayed, recorded): {diff}")
        for name in CALLER_FIELDS:
            setattr(request, name, fields[name])
        return request

    def lengths(self, snap: dict[str, Any]) -> LengthModel:
        index = snap["model"]
        if index == len(self.models):
            model = LengthModel(**snap["params"])
            for step, prompt, found in snap["siblings"]:
                model._siblings[(step, prompt)] = list(found)
            for step, prompt, tokens in snap.get("progress", ()):
                model._progress[(step, prompt)] = tokens
            model.num_finished, model.num_capped = snap.get("finished", (0, 0))
            self.models.append(model)
        model = self.models[index]
        for prompt_id, pairs in snap["history"].items():
            if pairs is None:
                model._raw.pop(prompt_id, None)
                model._history.pop(prompt_id, None)
            else:
                raw = [(float(length), float(weight)) for length, weight in pairs]
                model._raw[prompt_id] = raw
                model._history[prompt_id] = _WeightedLengths(*zip(*raw))
            for group in [g for g in model._combined if g[1] == prompt_id]:
                del model._combined[group]
        return model

    def worker_states(self, snaps: list[dict[str, Any]]) -> list[WorkerState]:
        out = []
        for snap in snaps:
            worker = self.workers.get(snap["worker_id"])
            if worker is None:
                worker = self.workers[snap["worker_id"]] = WorkerState(snap["worker_id"], snap["capacity"])
            worker.capacity, worker.healthy = snap["capacity"], snap["healthy"]
            try:
                worker.running = {key: self.requests[key] for key in map(RequestKey._make, snap["running"])}
            except KeyError as err:
                raise ValueError(f"worker {worker.worker_id} runs {err} which no add_step introduced") from None
            out.append(worker)
        return out

    def play(self, events: Iterable[Event]) -> Iterator[Decision]:
        for i, event in enumerate(events):
            try:
                decision = self.play_one(i, event)
            except Exception as exc:  # noqa: BLE001 - say where the replay broke
                raise ReplayError(f"event {i} ({event.get('op')}): {exc!r}") from exc
            if decision is not None:
                yield decision

    def play_one(self, i: int, event: Event) -> Decision | None:
        op, where = event["op"], f"event {i} ({event['op']})"
        if op == "add_step":
            lengths = self.lengths(event["lengths"])
            requests = []
            for fields in event["requests"]:
                request = self.requests.get(_key(fields))
                if request is None:
                    request = self.requests[_key(fields)] = Request(**fields)
                else:  # re-added: the caller sets every field
                    for name, value in fields.items():
                        setattr(request, name, value)
                requests.append(request)
            self.policy.add_step(requests, lengths, event["now"])
        elif op == "schedule":
            quota = event.get("quota")
            assignments = self.policy.schedule(self.worker_states(event["workers"]), event["now"],
                                               StepQuota(quota) if quota is not None else None)
            return {"event": i, "op": "schedule", "now": event["now"],
                    "assignments": [assignment_fields(a) for a in assignments]}
        elif op == "on_chunk_done":
            self.policy.on_chunk_done(self.request(event["request"], where), event["worker_id"],
                                      event["num_new_tokens"], event["finished"], event["now"])
        elif op == "on_worker_lost":
            self.policy.on_worker_lost(event["worker_id"], [self.request(f, where) for f in event["requests"]],
                                       event["now"])
        elif op == "cancel_step":
            removed = self.policy.cancel_step(event["step_id"])
            return {"event": i, "op": "cancel_step", "removed": [list(r.key) for r in removed]}
        elif op != "start":
            raise ValueError(f"{where}: unknown event")
        return None


def replay(events: Iterable[Event], policy: Policy, mismatches: list[str] | None = None) -> list[Decision]:
    """Drive ``policy`` (fresh) through the recorded calls; returns its decisions in the
    format of ``decisions_of``. ``mismatches``, if given, collects every request whose
    policy-written fields differ from the recording when it is passed in again."""
    return list(_Replayer(policy, mismatches).play(events))


def first_difference(recorded: list[Decision], replayed: list[Decision]) -> str | None:
    for a, b in zip(recorded, replayed):
        if a != b:
            return f"event {a['event']} ({a['op']}):\n  recorded {json.dumps(a)}\n  replayed {json.dumps(b)}"
    if len(recorded) != len(replayed):
        return f"{len(recorded)} recorded decisions, {len(replayed)} replayed"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("events", help="JSON-lines file written by EventRecorder")
    parser.add_argument("--policy", default=None, help="policy to replay on (default: the recorded one)")
    parser.add_argument("--run", type=int, default=-1, help="which recorder run in the file (default: last)")
    args = parser.parse_args(argv)
    events = read_events(args.events, args.run)
    policy = policy_from_events(events, args.policy)
    mismatches: list[str] = []
    replayed: list[Decision] = []
    error = None
    try:
        for decision in _Replayer(policy, mismatches).play(events):
            replayed.append(decision)
    except ReplayError as exc:
        error = str(exc)
    recorded = decisions_of(events)
    num_assignments = sum(len(d.get("assignments", ())) for d in recorded)
    difference = first_difference(recorded[:len(replayed)] if error else recorded, replayed)
    recorded_name = events[0].get("policy") if events[0]["op"] == "start" else "?"
    print(f"{len(events)} events, {len(recorded)} decisions ({num_assignments} assignments) recorded "
          f"with {recorded_name}; replayed on {policy.name}")
    if difference is None and error is None:
        print("decisions: IDENTICAL")
        return 0
    if difference is not None:
        print("decisions: DIFFERENT; first difference at " + difference)
    if error is not None:
        print(f"replay stopped: the policy failed at {error}" + (" (after the decisions diverged)" if difference
                                                                   else ""))
        if difference is None:
            print("decisions: DIFFERENT (identical up to the failure)")
    if mismatches:
        print(f"first request-state divergence: {mismatches[0]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
