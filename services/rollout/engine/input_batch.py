"""What persists on the device between steps, so a step costs no host<->device waits.

A step sends the device its integers (token ids, positions, KV slots, block tables, the
sampler's rows) and reads back one thing: the sampled tokens and their logprobs. Nothing
else may make the host wait for the GPU:
  - ``Staging``: a persistent host buffer (pinned when the device is CUDA) and its device
    twin; a step's integers are written into the host side through numpy and go over in
    one non-blocking copy. An event recorded after the copy keeps the next step from
    rewriting the host side before the copy has read it.
  - ``SlotParams``: every request's sampling parameters (temperature, top-k, top-p,
    min-p, seed, logprobs mode) in a row ("slot") of persistent device arrays, written
    when a request arrives and copied over (non-blocking, only when a slot changed), so
    a step's per-row parameters are a gather on the device by slot, not seven
    host-to-device copies. The same rows on the host say which costly parts of the
    sampler run at all (a sort for top-k / top-p, min-p, processed logprobs): a host
    decision from host data (vLLM keeps sampling parameters in its persistent
    ``InputBatch`` the same way).
  - ``HostReader``: the step's one read, through a persistent pinned buffer.
  - ``BlockTables``: every running sequence's block table as a row of one persistent
    numpy array (the block manager writes a row when the table changes), so a step's
    block tables and KV slots are numpy gathers by row, not a Python list per sequence.
This module knows nothing about scheduling or models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 4  # entries: 16 bytes of int32, 32 of int64
_PAD = [0] * _ALIGN


def _pinned_pair(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host, device) buffers of n entries; on the CPU one tensor plays both parts."""
    if device.type != "cuda":
        host = torch.zeros(n, dtype=dtype)
        return host, host
    return torch.zeros(n, dtype=dtype, pin_memory=True), torch.zeros(n, dtype=dtype, device=device)


class Staging:
    """One dtype's host->device staging buffers, reused every step.

    A step's parts are written at aligned offsets of the host buffer and go over in one
    non-blocking copy; the device tensors handed out are views of the device buffer,
    kept by layout (the parts' offsets and shapes): a steady batch's steps share one
    layout, and making a view costs more host time than writing its values."""

    MAX_LAYOUTS = 256  # views kept; past this the cache starts over

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024):
        self.dtype, self.device = dtype, device
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._bounds: list[tuple[int, int]] = []
        self._end = 0  # the last stage's extent
        self._layout: tuple = ()  # the last stage's parts: (offset, shape) each
        self.generation = 0  # stages so far: a rewrite needs the last stage to be the one it rewrites
        self._views: dict[tuple, tuple[list[torch.Tensor], list[tuple[int, int]]]] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.host, self.dev = _pinned_pair(capacity, self.dtype, self.device)
        self.host_np = self.host.numpy()
        self.host_view = memoryview(self.host_np)  # the same entries, written as Python ints (no numpy call)
        self.capacity = capacity
        self._views = {}

    def stage(self, parts: list) -> list[torch.Tensor]:
        """``parts`` (lists of numbers) as device tensors: views of the device buffer, each
        from an aligned offset, all copied in one non-blocking copy. They are valid until
        the next ``stage`` (the next step). The parts are joined in a Python list and
        converted by one ``np.array``: on a busy host with cold caches that beats a numpy
        assignment per part (benchmarks/engine_host.py)."""
        flat: list[int] = []
        layout = []
        for part in parts:
            flat.extend(_PAD[:-len(flat) % _ALIGN])
            layout.append((len(flat), (len(part),)))
            flat.extend(part)
        end = len(flat)
        self._begin(end)
        self.host_np[:end] = flat
        return self._finish(tuple(layout), end)

    def stage_arrays(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """``stage`` for parts that are numpy arrays already, each handed back in its shape
        (no Python list in between)."""
        layout, end = [], 0
        for part in parts:
            end += -end % _ALIGN
            layout.append((end, part.shape))
            end += part.size
        self._begin(end)
        host = self.host_np
        for (a, _), part in zip(layout, parts):
            host[a:a + part.size] = part.reshape(-1)
        return self._finish(tuple(layout), end)

    def begin_rewrite(self) -> np.ndarray:
        """The host side, for writing new values into the last ``stage``'s parts in place
        (the same layout: its device tensors stay valid, with the new values once
        ``end_rewrite`` has copied them over). Parts not written keep their values. A few
        entries are written faster through ``host_view`` (the same memory) once this has
        been called."""
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the host side
        return self.host_np

    def end_rewrite(self) -> None:
        """Sends what ``begin_rewrite``'s caller wrote: the last stage's extent, in one
        non-blocking copy (nothing to send on the CPU: host and device are one buffer)."""
        if self._event is not None:
            self.dev[:self._end].copy_(self.host[:self._end], non_blocking=True)
            self._event.record()

    def reshape_last(self, shape: tuple) -> list[torch.Tensor] | None:
        """The last stage's layout with its last part now of ``shape`` (the parts before it
        where they were, with their values), for a rewrite that changes only that part's
        size: the parts' device tensors (the earlier ones views of the same entries: the
        last stage's tensors of them stay valid), or None, with nothing changed, where the
        buffer is too small."""
        first, _ = self._layout[-1]
        end = first + math.prod(shape)
        if end > self.capacity:
            return None
        self._end = end
        return self._views_of(self._layout[:-1] + ((first, shape),))

    def bounds(self, i: int) -> tuple[int, int]:
        """Where the last stage's i-th part lies in the buffer."""
        return self._bounds[i]

    def _begin(self, end: int) -> None:
        self.generation += 1
        self._end = end
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the host side (done long ago)
        if end > self.capacity:
            self._alloc(1 << (end - 1).bit_length())

    def _finish(self, layout: tuple, end: int) -> list[torch.Tensor]:
        if self._event is not None:
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
            self._event.record()
        return self._views_of(layout)

    def _views_of(self, layout: tuple) -> list[torch.Tensor]:
        """The device views of ``layout`` ((offset, shape) per part), made once per layout;
        it becomes the last stage's."""
        cached = self._views.get(layout)
        if cached is None:
            if len(self._views) >= self.MAX_LAYOUTS:
                self._views = {}
            bounds = [(a, a + math.prod(shape)) for a, shape in layout]
            cached = self._views[layout] = ([self.dev[a:b].view(shape) for (a, b), (_, shape) in zip(bounds, layout)],
                                            bounds)
        views, self._bounds = cached
        self._layout = layout
        return views

    def host_part(self, i: int) -> np.ndarray:
        """The host side of the last ``stage``'s i-th part (valid until the next)."""
        a, b = self._bounds[i]
        return self.host_np[a:b]


class SlotParams:
    """Each request's sampling parameters in one slot of persistent arrays (host and device).

    ``assign`` takes a free slot (growing the arrays when none is left), ``release`` gives
    it back; ``device_params`` returns the device arrays, first copying the host rows over
    if a slot changed since the last step (one non-blocking copy per array)."""

    FIELDS = (("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
              ("min_p", torch.float32), ("seed", torch.int64), ("processed", torch.bool))

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 256):
        self.vocab_size, self.device = vocab_size, device
        self._free: list[int] = []
        self._capacity = 0
        self._dirty = False
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        self.flags = np.zeros((0, 3), dtype=np.bool_)  # per slot: needs a sort, min-p, processed logprobs
        self._rows: tuple | None = None  # the last step's: (its StepSampling, its row slots' bytes, the gather)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        for name, dtype in self.FIELDS:
            host, dev = _pinned_pair(capacity, dtype, self.device)
            if old:
                host[:old] = self.host[name]
            self.host[name], self.dev[name], self.np[name] = host, dev, host.numpy()
        flags = np.zeros((capacity, 3), dtype=np.bool_)
        flags[:old] = self.flags
        self.flags = flags
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest slot first
        self._capacity = capacity
        self._dirty = True

    def assign(self, req) -> int:
        """A slot holding ``req``'s sampling parameters."""
        if not self._free:
            self._grow(2 * self._capacity)
        if self._event is not None:
            self._event.synchronize()  # the last copy has read the host rows
        slot = self._free.pop()
        top_k = max(req.top_k, 0)
        values = dict(temperature=req.temperature, top_k=top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed,
                      processed=req.logprobs_mode == "processed")
        for name, value in values.items():
            self.np[name][slot] = value
        self.flags[slot] = (0 < top_k < self.vocab_size or 0 < req.top_p < 1, req.min_p > 0,
                            values["processed"])
        self._dirty = True
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def device_params(self) -> dict[str, torch.Tensor]:
        if self._dirty:
            if self.device.type == "cuda":
                for name, _ in self.FIELDS:
                    self.dev[name].copy_(self.host[name], non_blocking=True)
                self._event.record()
            self._dirty = False
            self._rows = None
        return self.dev

    def rows(self, sampling: "StepSampling") -> tuple:
        """The sampler's per-row arguments for a step's rows: (temperature, top_k, top_p,
        min_p, seeds, processed or None when no row is, (any row sorts, any row uses
        min-p)). Gathered on the device by slot; a step whose rows are the last step's
        slots again (a steady decode batch) reuses the last gather: at once where it is
        the last step's ``StepSampling`` again (a restaged step: the same rows, the same
        slots), else where its slots read the same."""
        dev = self.device_params()
        last = self._rows
        if last is not None and last[0] is sampling:
            return last[2]
        key = sampling.row_slots_host.tobytes()
        if last is not None and last[1] == key:
            self._rows = sampling, key, last[2]
            return last[2]
        slots = sampling.row_slots
        need_sort, need_min_p, any_processed = self.flags[sampling.row_slots_host].any(axis=0).tolist()
        rows = (dev["temperature"].index_select(0, slots), dev["top_k"].index_select(0, slots),
                dev["top_p"].index_select(0, slots), dev["min_p"].index_select(0, slots),
                dev["seed"].index_select(0, slots),
                dev["processed"].index_select(0, slots) if any_processed else None, (need_sort, need_min_p))
        self._rows = sampling, key, rows
        return rows

@dataclass
class StepSampling:
    """The sampler's rows of one step, in logits-row order (host lists made in ``prepare``)."""

    row_slots: torch.Tensor  # [num_rows] int64 on the device: each row's request slot
    positions: torch.Tensor  # [num_rows] int64 on the device: the absolute position each row samples
    masked: torch.Tensor | None  # [num_masked] int64 on the device: row * vocab + token, stop tokens
    #                              out of the distribution before min_tokens; None when none is
    row_slots_host: np.ndarray  # [num_rows] the same slots, on the host
    # Set for a decode-layout step only (every sequence feeds its last token, then perhaps
    # a linear draft, and masks no stop token; every fed token is a row): the token fed at
    # each row, and where each sequence's rows start (verifier.verify_linear accepts drafts
    # from them).
    fed_host: np.ndarray | None = None  # [num_rows]
    query_start_host: np.ndarray | None = None  # [num_seqs + 1]
    rows_per_seq: int = 0  # with them: every sequence's number of rows where it is the same (0: not known)


class HostReader:
    """The step's one wait for the device: its sampled tokens and their logprobs, copied
    into persistent pinned buffers behind the sampler (on CUDA: two non-blocking copies
    and an event; ``PendingRead.result`` waits for that event). On the CPU there is
    nothing to copy: the read holds the tensors themselves."""

    MAX_PAIRS = 64  # read_pair_later's buffers kept (by length and turn); past this the cache starts over

    def __init__(self):
        # read_pair_later's pinned buffers by (length, turn): tokens, logprobs, the event
        # recorded after their copies
        self._later: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}
        self._turn = 0

    def read_pair_later(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> "PendingRead":
        """A step's sampled tokens (int64) and logprobs (float32) read without waiting: on
        CUDA, each copied into a pinned buffer, non-blocking, behind the work that makes
        them, an event recorded after the copies; ``PendingRead.result`` then waits for
        those copies alone, not for what was queued after them (the next step's
        forward). On the CPU they are the host's already (kept, not copied). The pinned
        buffers are used by turns: a pending read stays valid through the next call (a
        step's read is taken during the next step, after that step's own call)."""
        if not tokens.is_cuda:
            return PendingRead(tokens, logprobs, None)
        self._turn ^= 1
        key = tokens.shape[0], self._turn
        entry = self._later.get(key)
        if entry is None:
            if len(self._later) >= self.MAX_PAIRS:
                self._later = {}
            n = tokens.shape[0]
            entry = self._later[key] = (torch.empty(n, dtype=torch.int64, pin_memory=True),
                                        torch.empty(n, dtype=torch.float32, pin_memory=True), torch.cuda.Event())
        host_tokens, host_logprobs, event = entry
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        event.record()
        return PendingRead(host_tokens, host_logprobs, event)


class PendingRead:
    """A read of a step's tokens and logprobs queued by ``HostReader.read_pair_later``."""

    __slots__ = ("_tokens", "_logprobs", "_event")

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, event):
        self._tokens, self._logprobs, self._event = tokens, logprobs, event

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens (int64) and logprobs (float32), valid until the reader's second next
        read_pair_later: on CUDA, once their copies have landed (the step's one wait for
        the device)."""
        if self._event is not None:
            self._event.synchronize()
        return self._tokens.numpy(), self._logprobs.numpy()


class BlockTables:
    """Each running sequence's block table in a row of one persistent int32 array.

    A sequence gets a row when it is admitted (it holds KV blocks) and gives it back when
    its blocks are freed (finished, aborted, preempted). The block manager reports each
    change of a table as it makes it (``extend``, ``truncate``, ``release``); the changes
    are held in a dict by (row, column), the latest winning, and written into the array
    in one numpy assignment by ``sync``, which the step's layout calls before it gathers
    rows (a change costs a dict entry, not numpy calls, on the block manager's path).
    Entries past a row's length are 0 once synced (cleared as a table shrinks and when the
    row is given back), so a gathered row is the table padded with zeros, whichever
    sequence held the row before. The array grows (rows, columns) on demand."""

    MAX_HELD = 1 << 16  # changes held before they are written anyway (a run whose steps never gather)
    SCALAR_SYNC_MAX = 8  # up to this many held changes are written one by one (numpy calls cost more)
    SYNC_LOG = 4  # the latest syncs' changes kept for ``changes_since``
    SYNC_LOG_MAX_ENTRIES = 64  # a sync of more changes is not kept (changes_since answers None across it)

    def __init__(self, rows: int = 16, cols: int = 16):
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self.view = memoryview(self.array)  # the same: view[row, col] reads an entry as a Python int
        self.lengths = np.zeros(rows, dtype=np.int64)
        self.lengths_view = memoryview(self.lengths)
        # Bumped whenever a row is taken or given back (an admission, a finish, an abort, a
        # preemption): a step laid out from the last step's state (step_inputs.SteadyBatch)
        # needs every sequence still in the row it had, and no other change.
        self.epoch = 0
        self.version = 0  # bumped by every change of a table (a step that gathered none can reuse its gather)
        self._free = list(range(rows - 1, -1, -1))  # lowest row first
        self._entries: dict[tuple[int, int], int] = {}  # changes not yet synced: (row, column) -> block
        self._lengths: dict[int, int] = {}  # row -> its table's length, not yet synced
        # The latest syncs' changes, (version when synced, {(row, column): block}) each, and
        # the latest version whose changes are no longer all kept (``changes_since``)
        self._synced: list[tuple[int, dict[tuple[int, int], int]]] = []
        self._forgotten = -1

    def assign(self) -> int:
        self.epoch += 1
        if not self._free:
            rows = self.array.shape[0]
            self._resize(2 * rows, self.array.shape[1])
            self._free.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def extend(self, row: int, first: int, blocks: list[int]) -> None:
        """The row's table, ``first`` blocks long, had ``blocks`` appended."""
        self.version += 1
        entries = self._entries
        for col, block in enumerate(blocks, first):
            entries[row, col] = block
        self._lengths[row] = first + len(blocks)
        if len(entries) > self.MAX_HELD:
            self.sync()

    def truncate(self, row: int, num_blocks: int, old_length: int) -> None:
        """The row's table, ``old_length`` blocks long, was cut to ``num_blocks``."""
        self.version += 1
        entries = self._entries
        for col in range(num_blocks, old_length):
            entries[row, col] = 0
        self._lengths[row] = num_blocks
        if len(entries) > self.MAX_HELD:
            self.sync()

    def release(self, row: int, old_length: int) -> None:
        """The row's sequence, its table ``old_length`` blocks long, gave its blocks back."""
        self.truncate(row, 0, old_length)
        self._free.append(row)
        self.epoch += 1

    def sync(self) -> None:
        """Writes the held changes into ``array`` and ``lengths``: a few (a decode step's
        new block, or none) entry by entry, more in one numpy assignment."""
        entries = self._entries
        if entries:
            if len(entries) <= self.SCALAR_SYNC_MAX:
                self._fit(max(col for _, col in entries))
                array = self.array
                for at, block in entries.items():
                    array[at] = block
            else:
                rows, cols = np.array(list(entries), dtype=np.int64).T
                self._fit(int(cols.max()))
                self.array[rows, cols] = list(entries.values())
            self._entries = {}
            log = self._synced
            if len(entries) > self.SYNC_LOG_MAX_ENTRIES:
                log.clear()
                self._forgotten = self.version
            else:
                log.append((self.version, entries))
                if len(log) > self.SYNC_LOG:
                    self._forgotten = log.pop(0)[0]
        held = self._lengths
        if held:
            if len(held) <= self.SCALAR_SYNC_MAX:
                lengths = self.lengths
                for row, length in held.items():
                    lengths[row] = length
            else:
                self.lengths[list(held)] = list(held.values())
            self._lengths = {}

    def changes_since(self, version: int) -> list[dict[tuple[int, int], int]] | None:
        """The changes synced since the tables were at ``version`` (``version``: read after
        a sync), in order, as {(row, column): block} each (later ones win); None where
        they are no longer all kept. A gather of a few rows at ``version`` is brought up
        to date by writing just these (``step_inputs._restage_scalars``)."""
        if version < self._forgotten:
            return None
        return [entries for synced, entries in self._synced if synced > version]

    def _fit(self, column: int) -> None:
        """Widens the array (at least doubling it) where ``column`` is past its columns."""
        if column >= self.array.shape[1]:
            self._resize(self.array.shape[0], max(column + 1, 2 * self.array.shape[1]))

    def _resize(self, rows: int, cols: int) -> None:
        array = np.zeros((rows, cols), dtype=np.int32)
        lengths = np.zeros(rows, dtype=np.int64)
        old_rows, old_cols = self.array.shape
        array[:old_rows, :old_cols] = self.array
        lengths[:old_rows] = self.lengths
        self.array, self.lengths = array, lengths
        self.view, self.lengths_view = memoryview(array), memoryview(lengths)


class VerifyStats:
    """Per request slot, what ``Sequence.record_verify`` counts (verify steps, draft tokens,
    accepted tokens, accepted drafts per position), summed by array operations for a whole
    decode-layout step (``record``) instead of one call per sequence. ``drain`` adds a
    slot's totals into its sequence, where its output reads them, and clears the slot; the
    engine drains a sequence before making its output and when its slot is given back.
    A slot's counts are one row of ``table`` (a step's rows gathered, summed into and
    written back once): verify steps, draft tokens, accepted tokens, the longest draft
    verified (the used length of the per-position counts), then the drafts accepted at
    each position."""

    STEPS, DRAFTS, ACCEPTED, LONGEST, PER_POS = range(5)  # table's columns (PER_POS: the first of them)

    def __init__(self, slots: int = 256, positions: int = 8):
        self.table = np.zeros((slots, self.PER_POS + positions), dtype=np.int64)
        self._held: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # record_later's, in order

    def record_later(self, slots: np.ndarray, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """``record`` at the next ``apply`` (the engine's, after it launches the next
        forward) or before the next ``drain``, whichever comes first; the arrays must not
        change meanwhile."""
        self._held.append((slots, num_draft, num_accepted))

    def apply(self) -> None:
        """The ``record`` calls that ``record_later`` held, in order."""
        if self._held:
            held, self._held = self._held, []
            for args in held:
                self.record(*args)

    def record(self, slots: np.ndarray, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's verdicts: sequence i, in slot ``slots[i]`` (each slot at most once),
        verified ``num_draft[i]`` draft tokens and accepted ``num_accepted[i]``."""
        drafted = num_draft > 0
        if not drafted.all():
            if not drafted.any():
                return
            slots, num_draft, num_accepted = slots[drafted], num_draft[drafted], num_accepted[drafted]
        self._fit(int(slots.max()) + 1, int(num_draft.max()))
        rows = self.table[slots]
        rows[:, self.STEPS] += 1
        rows[:, self.DRAFTS] += num_draft
        rows[:, self.ACCEPTED] += num_accepted
        np.maximum(rows[:, self.LONGEST], num_draft, out=rows[:, self.LONGEST])
        most = int(num_accepted.max())
        if most:
            rows[:, self.PER_POS:self.PER_POS + most] += np.arange(most) < num_accepted[:, None]
        self.table[slots] = rows

    def drain(self, seq) -> None:
        """Adds the slot's totals into ``seq`` (as its record_verify calls would have) and
        clears the slot."""
        self.apply()
        slot = seq.slot
        if not 0 <= slot < len(self.table) or not self.table[slot, self.STEPS]:
            return
        row = self.table[slot]
        steps, drafts, accepted, longest = row[:self.PER_POS].tolist()
        seq.num_verify_steps += steps
        seq.num_draft_tokens += drafts
        seq.num_accepted_tokens += accepted
        per_pos = seq.accepted_per_pos
        if len(per_pos) < longest:
            per_pos.extend([0] * (longest - len(per_pos)))
        for i, n in enumerate(row[self.PER_POS:self.PER_POS + longest].tolist()):
            per_pos[i] += n
        row[:] = 0

    def _fit(self, slots: int, positions: int) -> None:
        old_slots, old_width = self.table.shape
        width = self.PER_POS + positions
        if slots <= old_slots and width <= old_width:
            return
        slots = max(slots, 2 * old_slots) if slots > old_slots else old_slots
        table = np.zeros((slots, max(width, old_width)), dtype=np.int64)
        table[:old_slots, :old_width] = self.table
        self.table = table
