"""Counts, on the CPU, what would make the host wait for the GPU during an engine step.

On a GPU, ``torch.cuda.set_sync_debug_mode`` reports every synchronising call; there is
no such thing on the CPU, where every tensor is already on the host. ``HostReads`` is a
``TorchFunctionMode`` that records the calls that synchronise when the tensors live on
a GPU, by what they are, whatever the device:
  - reads of a tensor's values on the host: ``.item``, ``.tolist``, ``.cpu``, ``.numpy``,
    ``bool()``, ``int()``, ``float()``, ``operator.index`` of a tensor;
  - blocking copies: ``.to(device)`` / ``.copy_`` / ``torch.tensor(..., device=)`` /
    ``torch.as_tensor(..., device=)`` without ``non_blocking=True`` (a pageable
    host-to-device copy waits for the GPU's queue to drain);
  - operations whose result's shape depends on values (``nonzero``, ``masked_select``,
    indexing with a boolean tensor, or with a Python list, which is copied to the device).
Calls made inside ``pause()`` are not counted: the runner pauses it around the model's
forward, whose CPU kernels are the references of Triton kernels replayed in a CUDA graph
on a GPU (a graph cannot hold a host read at all). A queued read's ``PendingRead.result``
(input_batch.py) counts as one read, whatever it calls: on a GPU it is one wait for an
event, then views of pinned host memory.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode

from services.rollout.engine.input_batch import PendingRead

_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_SHAPE_FROM_VALUES = {"nonzero", "masked_select", "unique", "argwhere"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_"}
_CREATE = {"tensor", "as_tensor"}


def _is_device(x) -> bool:
    return isinstance(x, (torch.device, str)) and not isinstance(x, torch.dtype)


def _value_indexed(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []  # (what, where)
        self._paused = 0

    @contextlib.contextmanager
    def pause(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            what = self._classify(getattr(func, "__name__", ""), args, kwargs)
            if what:
                self.calls.append((what, _caller()))
        return func(*args, **kwargs)

    @staticmethod
    def _classify(name: str, args, kwargs) -> str | None:
        if name in _READS or name in _SHAPE_FROM_VALUES:
            return name
        blocking = not kwargs.get("non_blocking", False)
        if name == "to" and blocking and (_is_device(kwargs.get("device")) or any(_is_device(a) for a in args[1:2])):
            return "blocking .to(device)"
        if name == "copy_" and blocking and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].device != args[0].device:
            return "blocking copy_"
        if name in _CREATE and kwargs.get("device") is not None:
            return f"torch.{name}(device=)"
        if name in _INDEXING and len(args) > 1 and _value_indexed(args[1]):
            return f"{name} by values"
        return None


def _caller() -> str:
    """The innermost frame outside this file and torch: where the call was made."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def counting_host_reads(engine):
    """``HostReads`` over ``engine``'s steps, paused during the model's forward."""
    reads = HostReads()
    model, forward = engine.model, engine.model.forward

    def paused_forward(*args, **kw):
        with reads.pause():
            return forward(*args, **kw)

    result = PendingRead.result

    def one_read(pending):
        reads.calls.append(("PendingRead.result", _caller()))
        with reads.pause():
            return result(pending)

    model.forward = paused_forward
    PendingRead.result = one_read
    try:
        with reads:
            yield reads
    finally:
        del model.forward  # the class's method again
        PendingRead.result = result
