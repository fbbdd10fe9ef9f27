"""Placement policies, chosen by config name: ``make_policy("seer", chunk_size=1024)``."""

import inspect

from services.scheduler.policies.base import Assignment, Policy, Request, WorkerState
from services.scheduler.policies.histopipe import HistoPipePolicy
from services.scheduler.policies.rhymerl import RhymeRLPolicy
from services.scheduler.policies.seer import SeerPolicy
from services.scheduler.policies.static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (StaticPolicy, SeerPolicy, HistoPipePolicy, RhymeRLPolicy)}


def make_policy(name: str, **kwargs) -> Policy:
    """A new policy by name; ``kwargs`` go to its constructor.

    Raises:
        ValueError: unknown name.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(**kwargs)


def policy_options(name: str) -> set[str]:
    """The keyword options the named policy takes (e.g. ``chunk_size`` when it divides
    requests into chunks); empty for an unknown name."""
    return set(inspect.signature(POLICIES[name]).parameters) if name in POLICIES else set()


__all__ = ["POLICIES", "Assignment", "Policy", "Request", "WorkerState", "make_policy", "policy_options"]
