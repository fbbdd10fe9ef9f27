"""Replay recorded policy calls (services/scheduler/event_log.py) on a fresh policy.

``replay(events, policy)`` makes the same calls on a fresh policy: Request objects are
rebuilt once per request key and keep their identity across calls (policies hold them),
WorkerState objects once per worker_id; the LengthModel is rebuilt from the recorded
state. It returns the fresh policy's decisions, which a deterministic policy makes
identically to the recorded ones.

``python -m services.scheduler.simulator.replay EVENTS.jsonl --policy rhymerl`` replays a
recording (e.g. the live scheduler's, ``RHYMERL_SCHEDULER_RECORD_EVENTS``) and prints
whether the decisions match, and the first difference if not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from services.common.cost_curve import CostCurve
from services.scheduler.event_log import CALLER_FIELDS, Decision, Event, assignment_fields, decisions_of, read_events
from services.scheduler.length_model import LengthModel, _WeightedLengths
from services.scheduler.policies import make_policy, policy_options
from services.scheduler.policies.base import Policy, Request, RequestKey, StepQuota, WorkerState


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
