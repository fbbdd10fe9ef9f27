"""CompiledDrafter: HistoDrafter's drafts from the C++ core (native/histo.cpp), batched.

The same lifecycle and the same drafts as the Python `HistoDrafter` (the reference the
tests hold it to, draft for draft), at a few microseconds per sequence per step:

- One C call per engine step drafts for the whole batch (`propose`): requests are integer
  slots, the step's inputs are packed into one buffer bound to the core once (`rhd_bind`),
  so the call itself takes only the drafter's handle, and the drafts come back back to
  back in one buffer with their offsets. The cost threshold (`budget.gain_threshold`) is
  computed in the core from the cost model's curve, which is handed over only when the
  cost model says it changed (`CostModel.version`).
- Draft trees (`propose_trees`, with `DrafterConfig.tree`): the same step's inputs, one C
  call (`rhd_step_trees`) growing each request's tree as tree_walk.py does and cutting the
  batch to the budget, the trees back to back with their parents in buffers bound once
  (grown when a call needs more room). `record_tree_acceptance` is a staged commit.
- A step's commits in one call: `commit_step` (what both engines call after a verify)
  hands every request's record_acceptance and add_tokens of the step to the core at
  once, one row per request (slot, draft length, accepted, token count) and the tokens
  back to back, in one C call (`rhd_commit`), validated there before any is applied.
- The engine-facing per-request calls (`add_tokens`, `record_acceptance`,
  `record_tree_acceptance`) still work and are deferred: each stages a row (validated
  as it is staged); the staged rows reach the core in one call (`flush`), which every
  other call runs first (or the engine calls `flush` itself, e.g. while a forward runs:
  ctypes releases the GIL).
- Bad input raises a Python exception naming the field (checked here and again in C++),
  never a crash: token ids outside [0, 2^31 - 1), unknown or stopped requests, more
  requests than slots (`DrafterFullError`).

The library is built by `make install` (native/build.py). A missing or unloadable library
raises `DrafterLibraryError` naming `make install`; nothing falls back to Python silently.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import sys
from array import array
from functools import partial
from itertools import repeat
from operator import is_not
from collections.abc import Iterable, Sequence
from pathlib import Path
from struct import Struct
from struct import error as StructError

import numpy as np

from services.rollout.drafter.config import DrafterConfig
from services.rollout.drafter.drafter import UnknownRequestError
from services.rollout.drafter.prompt_index import reward_factors
from services.rollout.drafter.request_state import DrafterStats

LIBRARY = Path(__file__).resolve().parent / "native" / "libhisto.so"
BUNDLED = Path(__file__).resolve().parents[3] / ".gpu-bundle" / "lib" / "libhisto.so"  # make gpu-bundle
LIBRARY_ENV = "RHYMERL_DRAFTER_LIBRARY"  # another build of it (the tests' sanitized one)
ABI_VERSION = 6
MAX_TOKEN = 2**31 - 1  # token ids the core takes: [0, MAX_TOKEN] (an int32's)
_INT31 = 2**31 - 1
_STATS = 6  # RHD_STAT_COUNT
_NO_STOPS: frozenset[int] = frozenset()
_P, _I32, _I64, _D = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "rhd_abi_version": (ctypes.c_int, []),
    "rhd_create": (_P, [_P, _I32, _P, _I32, _P]),
    "rhd_destroy": (None, [_P]),
    "rhd_last_error": (ctypes.c_char_p, [_P]),
    "rhd_load_history": (ctypes.c_int, [_P, _I64, _P, _P, _I32, _P, _P]),
    "rhd_add_global": (ctypes.c_int, [_P, _P, _P, _I32]),
    "rhd_has_prompt": (ctypes.c_int, [_P, _I64]),
    "rhd_release_prompt": (ctypes.c_int, [_P, _I64]),
    "rhd_start": (ctypes.c_int, [_P, _I32, _I64, _P, _I64, _P, _I64]),
    "rhd_stop": (ctypes.c_int, [_P, _I32]),
    "rhd_set_stops": (ctypes.c_int, [_P, _I32, _P, _I32]),
    "rhd_set_stops_many": (ctypes.c_int, [_P, _I32, _P, _P, _P]),
    "rhd_commit": (ctypes.c_int, [_P, _I32, _P, _P, _P, _P, _P, _I64]),
    "rhd_bind_commit": (ctypes.c_int, [_P, _P]),
    "rhd_commit_bound": (ctypes.c_int, [_P]),
    "rhd_propose": (ctypes.c_int, [_P, _I32, _P, _P, _I64, _D, _P, _P, _P]),
    "rhd_memory_tokens": (ctypes.c_int64, [_P, _I64]),
    "rhd_memory_bytes": (ctypes.c_int64, [_P, _I64]),
    "rhd_global_tokens": (ctypes.c_int64, [_P]),
    "rhd_global_bytes": (ctypes.c_int64, [_P]),
    "rhd_prompt_totals": (ctypes.c_int, [_P, _P]),
    "rhd_bind": (ctypes.c_int, [_P, _P, _I32, _P, _P, _P]),
    "rhd_step": (ctypes.c_int, [_P]),
    "rhd_bind_trees": (ctypes.c_int, [_P, _I32, _I64, _P, _P, _P, _P]),
    "rhd_step_trees": (ctypes.c_int, [_P, _I64, _I64]),
    "rhd_set_curve": (ctypes.c_int, [_P, _P, _P, _I32]),
    "rhd_gain_threshold": (ctypes.c_int, [_P, _I64, _D, _D, _P]),
}
_NO_BUDGET = -2**63  # rhd_step's "no limit"
_HEADER = 4  # rhd_step's params: n, budget, min_gain, num_seqs, then the slots and the max_lens
_COMMIT = Struct("=7q")  # rhd_commit_bound's block: n, the five columns' addresses, the token count
_LOADED: dict[str, ctypes.CDLL] = {}


class DrafterLibraryError(RuntimeError):
    """The compiled drafter's library is missing or does not load."""


class DrafterFullError(ValueError):
    """More running requests than the drafter has slots."""


class DrafterError(RuntimeError):
    """The core refused a call (its message says why) or ran out of memory."""


DRAFTERS = ("compiled", "python")  # RHYMERL_WORKER_DRAFTER


def make_drafter(kind: str, config: DrafterConfig | None = None, max_slots: int = 16384):
    """The worker's drafter: "compiled" (CompiledDrafter; DrafterLibraryError if its library
    is missing, never a silent fallback) or "python" (the reference HistoDrafter)."""
    if kind == "compiled":
        return CompiledDrafter(config, max_slots=max_slots)
    if kind == "python":
        from services.rollout.drafter.drafter import HistoDrafter

        return HistoDrafter(config)
    raise ValueError(f"drafter must be one of {DRAFTERS}, not {kind!r}")


def library_path() -> Path:
    """$RHYMERL_DRAFTER_LIBRARY, else the build of `make install`, else the GPU bundle's
    copy (`make gpu-bundle`: lib/libhisto.so, checked against its manifest on load)."""
    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    if not LIBRARY.exists() and BUNDLED.exists():
        return BUNDLED
    return LIBRARY


def _check_bundled(path: Path) -> None:
    """The bundle's copy must be the one its manifest lists (size and SHA-256)."""
    manifest = json.loads((path.parent.parent / "manifest.json").read_text())
    entry = manifest.get("files", {}).get("lib/libhisto.so")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if entry is None or entry.get("sha256") != digest:
        raise DrafterLibraryError(f"{path} does not match its bundle's manifest: rebuild it (`make gpu-bundle`)")


def load_library(path: str | Path | None = None) -> ctypes.CDLL:
    """The core's library (cached per path), its functions typed.

    Raises:
        DrafterLibraryError: missing, not loadable, or of another ABI version; the message
            names `make install`, which builds it.
    """
    path = Path(path) if path is not None else library_path()
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    if not path.is_file():
        raise DrafterLibraryError(f"the compiled drafter library {path} is missing: run `make install` "
                                  "(or set RHYMERL_WORKER_DRAFTER=python)")
    try:
        if path == BUNDLED:
            _check_bundled(path)
        lib = ctypes.CDLL(key)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError, ValueError) as exc:
        raise DrafterLibraryError(f"the compiled drafter library {path} does not load ({exc}): "
                                  "run `make install`") from None
    if lib.rhd_abi_version() != ABI_VERSION:
        raise DrafterLibraryError(f"the compiled drafter library {path} is of another version: run `make install`")
    _LOADED[key] = lib
    return lib


def _tokens(values, field: str) -> np.ndarray:
    """Token ids as a contiguous int32 array; ValueError naming the field if one is out of range."""
    try:
        arr = np.asarray(values, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{field}: token ids must be integers ({exc})") from None
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise ValueError(f"{field}: token id {bad} is out of range [0, {MAX_TOKEN}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _flatten(responses, field: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = [_tokens(r, field) for r in responses]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    if arrays:
        np.cumsum([a.size for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    return np.ascontiguousarray(flat, dtype=np.int32), offsets


def _addr(arr: np.ndarray) -> int:
    return arr.ctypes.data if arr.size else 0


class CompiledDrafter:
    """HistoDrafter's lifecycle on the compiled core (see the module docstring). Not
    thread-safe: one engine loop drives it.

    Args:
        config: the drafter's settings (as HistoDrafter's).
        max_slots: the most requests started at once (running or queued in the engine).
        library: the shared library's path (None: `library_path()`).
    """

    def __init__(self, config: DrafterConfig | None = None, max_slots: int = 16384,
                 library: str | Path | None = None) -> None:
        if not 1 <= max_slots <= 1 << 24:
            raise ValueError("max_slots must be in [1, 2^24]")
        self._lib = lib = load_library(library)
        self._config = config = config or DrafterConfig()
        self.max_slots = max_slots
        self._stats = (ctypes.c_double * _STATS)()
        self._handle = None
        self._handle = self._create(config)
        h = self._handle
        self._slots: dict[str, int] = {}
        self._free = list(range(max_slots - 1, -1, -1))  # slot 0 first
        self._slot_prompt: list[str | None] = [None] * max_slots
        self._slot_stops: list[object] = [_NO_STOPS] * max_slots
        self._prompts: dict[str, int] = {}  # prompt id -> the core's handle
        self._next_prompt = 1
        # Staged commits (rhd_commit's rows): per request its slot, draft length (-1: a
        # tree's acceptance), accepted count and token count (-1: no add_tokens), and the
        # tokens back to back. Slots, accepted counts and tokens are unsigned ("I"): the
        # same bits as the core's int32 (which rejects what reads negative), and CPython
        # stores an item into an unsigned array directly where a signed one parses it
        # (PyArg_Parse, ~380 instructions an item); the two columns with -1 are signed.
        self._c_slots, self._c_drafts = array("I"), array("i")
        self._c_accepted, self._c_counts = array("I"), array("i")
        self._toks = array("I")
        # The step's buffers, allocated once and bound to the core once (rhd_bind).
        k = max(1, config.max_draft_len)
        self._params = np.zeros(_HEADER + 2 * max_slots, dtype=np.int64)
        self._out_tokens = np.zeros(max_slots * k, dtype=np.int32)
        self._out_gains = np.zeros(max_slots * k, dtype=np.float64)
        self._out_offsets = np.zeros(max_slots + 1, dtype=np.int32)
        self._tokens_view = memoryview(self._out_tokens)  # slices of it: .tolist() without numpy's overhead
        self._offsets_view = memoryview(self._out_offsets)
        self._check(lib.rhd_bind(h, self._params.ctypes.data, max_slots, self._out_tokens.ctypes.data,
                                 self._out_gains.ctypes.data, self._out_offsets.ctypes.data))
        # per batch size: the step's packer (made ahead for small batches: the tail's steps
        # are short, so making one there would cost more than the step's drafting)
        self._packs: dict[int, Struct] = {n: Struct(f"=qqdq{n}q{n}q") for n in range(min(max_slots, 64) + 1)}
        self._curve_model, self._curve_version = None, None  # the cost model (and its version) the core has
        self._tree_rows = self._tree_nodes = 0  # the tree buffers bound (rhd_bind_trees), made at first use
        self._step = partial(lib.rhd_step, h)
        # rhd_commit's arguments go through a block bound once (one argument to convert, not eight)
        self._commit_block = np.zeros(7, dtype=np.int64)
        self._block_words = memoryview(self._commit_block)  # (one word written without numpy's overhead)
        self._block_bytes = self._block_words.cast("B")
        self._check(lib.rhd_bind_commit(h, self._commit_block.ctypes.data))
        self._commit_bound = partial(lib.rhd_commit_bound, h)
        # one request's commit row (_commit_one) and the block pointing at it or at the columns
        self._row_tokens = 0
        self._make_row(64)
        self._row_packs: dict[int, Struct] = {k: Struct(f"=4i{k}i") for k in range(65)}

    def _create(self, config: DrafterConfig):
        ci = (ctypes.c_int64 * 11)(
            config.use_history, config.use_siblings, config.use_prompt, config.use_global,
            config.max_tokens_per_prompt, int(config.max_tokens_per_prompt * config.history_fraction),
            config.global_max_tokens, config.min_match_len, config.max_draft_len, sys.version_info >= (3, 12),
            self.max_slots)
        cd = (ctypes.c_double * 6)(config.sibling_weight, config.prompt_weight, config.smoothing,
                                   config.backoff_weight, config.match_len_prior, config.global_match_len_prior)
        handle = self._lib.rhd_create(ci, 11, cd, 6, self._stats)
        if not handle:
            raise ValueError("the compiled drafter refused the config (a bound out of range, a negative or "
                             "non-finite weight, max_draft_len > 4096, max_tokens > 2^30) or memory is short")
        return handle

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.rhd_destroy(handle)

    @property
    def config(self) -> DrafterConfig:
        return self._config

    @config.setter
    def config(self, config: DrafterConfig) -> None:
        """Only the cost model may change on a drafter in use (the worker sets it once the
        engine has sized its cost curve); other fields need a fresh drafter."""
        if dataclasses.replace(config, cost_model=None) != dataclasses.replace(self._config, cost_model=None):
            raise ValueError("a CompiledDrafter's settings other than cost_model are fixed; make a new drafter")
        self._config = config

    def _check(self, rc: int) -> int:
        if rc < 0:
            message = self._lib.rhd_last_error(self._handle).decode(errors="replace")
            if rc == -1:
                raise ValueError(message)
            raise DrafterError(message)
        return rc

    # -- sources ---------------------------------------------------------------------

    def load_history(self, prompt_id: str, responses: Sequence[np.ndarray | list[int]],
                     epoch_ages: Sequence[int] | None = None, rewards: Sequence[float] | None = None) -> None:
        """As HistoDrafter.load_history."""
        cfg = self._config
        ages = list(epoch_ages) if epoch_ages is not None else [0] * len(responses)
        if len(ages) != len(responses) or (rewards is not None and len(rewards) != len(responses)):
            raise ValueError("epoch_ages and rewards must have one entry per response")
        self.flush()
        factors = (reward_factors(rewards, cfg.reward_temperature) if cfg.reward_weighting and rewards is not None
                   else [1.0] * len(responses))
        weights = np.array([cfg.history_weight * cfg.recency_decay ** age * factor
                            for age, factor in zip(ages, factors)], dtype=np.float64)
        if any(not 0 <= int(a) <= _INT31 for a in ages):
            raise ValueError("epoch_ages must be in [0, 2^31)")
        flat, offsets = _flatten(responses, "responses")
        ages_arr = np.asarray(ages, dtype=np.int32)
        handle = self._prompts.get(prompt_id) or self._next_prompt
        self._check(self._lib.rhd_load_history(self._handle, handle, _addr(flat), _addr(offsets), len(responses),
                                               _addr(ages_arr), _addr(weights)))
        self._adopt(prompt_id, handle)

    def add_global_responses(self, responses: Iterable[np.ndarray | Sequence[int]]) -> None:
        """As HistoDrafter.add_global_responses."""
        flat, offsets = _flatten(list(responses), "responses")
        self.flush()
        self._check(self._lib.rhd_add_global(self._handle, _addr(flat), _addr(offsets), len(offsets) - 1))

    def has_prompt(self, prompt_id: str) -> bool:
        return prompt_id in self._prompts

    def release_prompt(self, prompt_id: str) -> None:
        handle = self._prompts.get(prompt_id)
        if handle is None:
            return
        self.flush()
        if self._check(self._lib.rhd_release_prompt(self._handle, handle)) == 1:
            del self._prompts[prompt_id]

    def _adopt(self, prompt_id: str, handle: int) -> None:
        if handle == self._next_prompt:
            self._next_prompt += 1
        self._prompts[prompt_id] = handle

    # -- requests --------------------------------------------------------------------

    def start_request(self, request_id: str, prompt_id: str, prompt_token_ids: Sequence[int],
                      generated_token_ids: Sequence[int] = ()) -> None:
        """As HistoDrafter.start_request.

        Raises:
            ValueError: the request is already running, or a token id is out of range.
            DrafterFullError: all `max_slots` slots are taken.
        """
        if request_id in self._slots:
            raise ValueError(f"request {request_id!r} already started")
        if not self._free:
            raise DrafterFullError(f"all {self.max_slots} drafter slots are taken (request {request_id!r})")
        prompt = _tokens(prompt_token_ids, "prompt_token_ids")
        generated = _tokens(generated_token_ids, "generated_token_ids")
        self.flush()
        slot = self._free[-1]
        handle = self._prompts.get(prompt_id) or self._next_prompt
        self._check(self._lib.rhd_start(self._handle, slot, handle, _addr(prompt), prompt.size, _addr(generated),
                                        generated.size))
        self._free.pop()
        self._adopt(prompt_id, handle)
        self._slots[request_id] = slot
        self._slot_prompt[slot] = prompt_id
        self._slot_stops[slot] = _NO_STOPS

    def add_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Stages the request's committed tokens (applied at the next `flush`).

        Raises:
            UnknownRequestError: the request was not started or was stopped.
            ValueError: a token id is out of range (nothing is staged).
        """
        slot = self._slots.get(request_id)
        if slot is None:
            raise UnknownRequestError(request_id)
        toks = self._toks
        before = len(toks)
        try:
            toks.extend(token_ids)  # uint32: OverflowError below 0 or past 2^32 - 1
        except (TypeError, OverflowError) as exc:
            del toks[before:]
            raise ValueError(f"token_ids: {exc} (token ids are in [0, {MAX_TOKEN}])") from None
        end = i = len(toks)
        while i > before:  # none past MAX_TOKEN (a loop: max() parses its arguments, ~2k instructions a call)
            i -= 1
            if toks[i] > MAX_TOKEN:
                bad = toks[i]
                del toks[before:]
                raise ValueError(f"token_ids: token id {bad} is out of range [0, {MAX_TOKEN}]")
        slots, counts = self._c_slots, self._c_counts
        if slots and slots[-1] == slot and counts[-1] == -1:  # after its record_acceptance: one row
            counts[-1] = end - before
        else:
            self._stage(slot, 0, 0, end - before)

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """Stages how much of the request's last draft was accepted (applied at `flush`)."""
        slot = self._slots.get(request_id)
        if slot is None:
            raise UnknownRequestError(request_id)
        if num_draft < 0 or num_accepted < 0 or num_draft > _INT31 or num_accepted > _INT31:
            raise ValueError("num_draft and num_accepted must be in [0, 2^31)")
        self._stage(slot, num_draft, num_accepted, -1)

    @property
    def tree_drafts(self) -> bool:
        """Whether the engine should ask ``propose_trees`` (DrafterConfig.tree)."""
        return self._config.tree

    def record_tree_acceptance(self, request_id: str, parents: list[int], path: list[int]) -> None:
        """Stages the accepted path (root to leaf) of the request's last tree (applied at
        `flush`): as HistoDrafter.record_tree_acceptance, counted as accepted tokens, the
        request's calibration not moved."""
        slot = self._slots.get(request_id)
        if slot is None:
            raise UnknownRequestError(request_id)
        num = len(path)
        if num > _INT31:
            raise ValueError("path: longer than 2^31 - 1 nodes")
        self._stage(slot, -1, num, -1)

    def _stage(self, slot: int, draft: int, accepted: int, count: int) -> None:
        self._c_slots.append(slot)
        self._c_drafts.append(draft)
        self._c_accepted.append(accepted)
        self._c_counts.append(count)

    def commit_step(self, request_ids: Sequence[str], num_draft: Sequence[int], num_accepted: Sequence[int],
                    token_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        """A step's commits for all its requests in one C call, in order: for request i,
        ``record_acceptance(request_ids[i], num_draft[i], num_accepted[i])`` where
        num_draft[i] > 0, then ``add_tokens`` of its ``num_tokens[i]`` tokens, the next ones
        of `token_ids` (each request's back to back), where num_tokens[i] >= 0 (-1: none).
        All or nothing: on an error nothing is applied.

        Raises:
            UnknownRequestError: a request was not started or was stopped.
            ValueError: lengths that disagree, a count or token id out of range (naming it).
        """
        n = len(request_ids)
        try:  # (one request, the tail's steps: no map to make, as in propose)
            slots = [self._slots[request_ids[0]]] if n == 1 else list(map(self._slots.__getitem__, request_ids))
        except KeyError as exc:
            raise UnknownRequestError(exc.args[0]) from None
        if len(num_draft) != n or len(num_accepted) != n or len(num_tokens) != n:
            raise ValueError("num_draft, num_accepted and num_tokens must have one entry per request")
        if n and min(num_draft) < 0:
            raise ValueError(f"num_draft: {min(num_draft)} is negative")
        if self._c_slots:
            self.flush()  # the calls staged before this one come first
        if n == 1:
            rc = self._commit_one(slots[0], num_draft[0], num_accepted[0], token_ids, num_tokens[0])
            if rc < 0:
                self._check(rc)
            return
        cs, cd, ca, cn, toks = self._c_slots, self._c_drafts, self._c_accepted, self._c_counts, self._toks
        try:
            cs.extend(slots)
            cd.extend(num_draft)
            ca.extend(num_accepted)
            cn.extend(num_tokens)
            toks.extend(token_ids)
            rc = self._commit(n)
        except (TypeError, OverflowError) as exc:  # a value no int32 column holds
            raise ValueError(f"commit_step: {exc} (counts in [-1, 2^31), token ids in [0, {MAX_TOKEN}])") from None
        finally:
            del cs[:], cd[:], ca[:], cn[:], toks[:]
        if rc < 0:
            self._check(rc)

    def flush(self) -> None:
        """Applies the staged commits in one call (in the order they were staged)."""
        cs = self._c_slots
        if not cs:
            return
        cd, ca, cn, toks = self._c_drafts, self._c_accepted, self._c_counts, self._toks
        try:
            rc = self._commit(len(cs))
        finally:
            del cs[:], cd[:], ca[:], cn[:], toks[:]
        self._check(rc)

    def _commit(self, n: int) -> int:
        """rhd_commit of the first `n` staged rows and all the staged tokens, through the bound block."""
        _COMMIT.pack_into(self._commit_block, 0, n, self._c_slots.buffer_info()[0], self._c_drafts.buffer_info()[0],
                          self._c_accepted.buffer_info()[0], self._c_counts.buffer_info()[0],
                          self._toks.buffer_info()[0], len(self._toks))
        self._block_at_row = False
        return self._commit_bound()

    def _commit_one(self, slot: int, num_draft: int, num_accepted: int, token_ids: Sequence[int],
                    num_tokens: int) -> int:
        """rhd_commit of one request's row (the tail's steps), through the bound block
        pointed at a row kept for it (slot, draft, accepted, count, then the tokens): one
        pack of the row and one word of the block, where the columns' path extends and
        clears five arrays and packs the block's seven words. The core validates the row."""
        k = len(token_ids)
        if k > self._row_tokens:
            self._make_row(k)
        pack = self._row_packs.get(k) or self._row_packs.setdefault(k, Struct(f"=4i{k}i"))
        try:
            pack.pack_into(self._row, 0, slot, num_draft, num_accepted, num_tokens, *token_ids)
        except (StructError, TypeError) as exc:  # a value no int32 holds
            raise ValueError(f"commit_step: {exc} (counts in [-1, 2^31), token ids in [0, {MAX_TOKEN}])") from None
        if not self._block_at_row:
            self._point_at_row()
        self._block_words[6] = k
        return self._commit_bound()

    def _make_row(self, num_tokens: int) -> None:
        """The one-request row for up to `num_tokens` tokens (at least twice the last)."""
        self._row_tokens = max(num_tokens, 2 * self._row_tokens)
        self._row = np.zeros(4 + self._row_tokens, dtype=np.int32)
        base = self._row.ctypes.data  # (once: `.ctypes` makes an object a call)
        self._row_block = _COMMIT.pack(1, base, base + 4, base + 8, base + 12, base + 16, 0)
        self._block_at_row = False

    def _point_at_row(self) -> None:
        """The bound block's columns at the one-request row (n = 1): the words made with
        the row, copied in."""
        self._block_bytes[:] = self._row_block
        self._block_at_row = True

    def stop_request(self, request_id: str) -> None:
        """As HistoDrafter.stop_request (staged commits are applied first)."""
        slot = self._slots.get(request_id)
        if slot is None:
            raise UnknownRequestError(request_id)
        try:
            self.flush()
        finally:
            del self._slots[request_id]
            self._free.append(slot)
            prompt_id, self._slot_prompt[slot] = self._slot_prompt[slot], None
            if self._check(self._lib.rhd_stop(self._handle, slot)) == 1:
                self._prompts.pop(prompt_id, None)

    # -- drafting ----------------------------------------------------------------------

    def propose(self, request_ids: Sequence[str], max_lens: Sequence[int],
                stop_token_ids: Sequence[frozenset[int]] | None = None,
                budget: int | None = None, num_seqs: int | None = None) -> list[list[int]]:
        """As HistoDrafter.propose: one C call for the whole batch (after the staged commits)."""
        n = self._pack(request_ids, max_lens, stop_token_ids, budget, num_seqs, self._config.min_gain)
        rc = self._step()
        if rc < 0:
            self._check(rc)
        if n == 1:  # the tail's steps: no offsets list to make
            return [self._tokens_view[:self._offsets_view[1]].tolist()]
        ends = self._offsets_view[:n + 1].tolist()
        flat = self._tokens_view[:ends[-1]].tolist()
        return list(map(flat.__getitem__, map(slice, ends, ends[1:])))

    def propose_trees(self, request_ids: Sequence[str], max_lens: Sequence[int],
                      stop_token_ids: Sequence[frozenset[int]] | None = None, budget: int | None = None,
                      max_nodes: int = 16, num_seqs: int | None = None) -> list[tuple[list[int], list[int] | None]]:
        """As HistoDrafter.propose_trees: trees (tokens, parents) at batches of at most
        `tree_max_batch` sequences with `tree` on, in one C call; `propose`'s linear drafts
        (draft, None) otherwise."""
        cfg = self._config
        n = len(request_ids)
        if not cfg.tree or (num_seqs or n) > cfg.tree_max_batch:
            return [(d, None) for d in self.propose(request_ids, max_lens, stop_token_ids, budget, num_seqs)]
        try:
            cap = min(int(max_nodes), cfg.max_draft_len * cfg.tree_width)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"max_nodes: {exc}") from None
        min_gain = cfg.min_gain if cfg.tree_min_gain is None else cfg.tree_min_gain
        n = self._pack(request_ids, max_lens, stop_token_ids, budget, num_seqs, min_gain)
        if not self._tree_nodes or n > self._tree_rows or cap > self._tree_nodes:
            self._bind_trees(max(n, self._tree_rows, min(cfg.tree_max_batch, self.max_slots)),
                             max(cap, self._tree_nodes, 1))
        self._check(self._lib.rhd_step_trees(self._handle, cap, cfg.tree_width))
        ends = self._tree_offsets[:n + 1].tolist()
        flat, parents = self._tree_tokens[:ends[-1]].tolist(), self._tree_parents[:ends[-1]].tolist()
        return [(flat[a:b], parents[a:b]) for a, b in zip(ends, ends[1:])]

    def _bind_trees(self, rows: int, nodes: int) -> None:
        """(Re)allocates the tree buffers for `rows` trees of `nodes` nodes and binds them."""
        if rows * nodes >= 2**31:
            raise ValueError(f"{rows} trees of {nodes} nodes: more than 2^31 nodes in one step")
        size = max(1, rows * nodes)
        self._tree_tokens = np.zeros(size, dtype=np.int32)
        self._tree_gains = np.zeros(size, dtype=np.float64)
        self._tree_parents = np.zeros(size, dtype=np.int32)
        self._tree_offsets = np.zeros(rows + 1, dtype=np.int32)
        self._check(self._lib.rhd_bind_trees(self._handle, rows, nodes, self._tree_tokens.ctypes.data,
                                             self._tree_gains.ctypes.data, self._tree_parents.ctypes.data,
                                             self._tree_offsets.ctypes.data))
        self._tree_rows, self._tree_nodes = rows, nodes

    def _pack(self, request_ids: Sequence[str], max_lens: Sequence[int], stop_token_ids, budget, num_seqs,
              min_gain: float) -> int:
        """A step's inputs into the bound params block (after the staged commits, the stop
        sets and the cost curve handed over where they changed); returns the batch size."""
        n = len(request_ids)
        if len(max_lens) != n or (stop_token_ids is not None and len(stop_token_ids) != n):
            raise ValueError("max_lens and stop_token_ids must have one entry per request")
        if n > self.max_slots:
            raise ValueError(f"{n} requests in one propose, more than the {self.max_slots} slots")
        try:
            ids = [self._slots[request_ids[0]]] if n == 1 else list(map(self._slots.__getitem__, request_ids))
        except KeyError as exc:
            raise UnknownRequestError(exc.args[0]) from None
        if self._c_slots:
            self.flush()
        cached = self._slot_stops
        if n == 1:  # the tail's steps: no iterators to make
            stops = _NO_STOPS if stop_token_ids is None else stop_token_ids[0]
            if cached[ids[0]] is not stops:
                self._set_stops(ids[0], stops)
        else:
            if stop_token_ids is None:
                stop_token_ids = repeat(_NO_STOPS, n)
            if any(map(is_not, map(cached.__getitem__, ids), stop_token_ids)):  # the stop sets changed
                self._set_stops_many([(slot, stops) for slot, stops in zip(
                    ids, stop_token_ids if not isinstance(stop_token_ids, repeat) else repeat(_NO_STOPS, n))
                    if cached[slot] is not stops])
        model = self._config.cost_model  # (_sync_curve, without its call)
        if model is not self._curve_model or (model is not None and model.version != self._curve_version):
            self._set_curve(model)
        pack = self._packs.get(n) or self._packs.setdefault(n, Struct(f"=qqdq{n}q{n}q"))
        try:
            pack.pack_into(self._params, 0, n, _NO_BUDGET if budget is None else budget, min_gain,
                           num_seqs or 0, *ids, *max_lens)
        except (StructError, TypeError):
            self._pack_slowly(pack, n, ids, max_lens, budget, num_seqs, min_gain)
        return n

    def _pack_slowly(self, pack: Struct, n: int, ids: list[int], max_lens, budget, num_seqs,
                     min_gain: float) -> None:
        """The step's inputs where the fast pack refused them: a budget that is not an int64
        (clamped, as the reference does), or a ValueError naming the bad field."""
        try:
            lens = [int(x) for x in max_lens]
            Struct(f"={n}q").pack(*lens)
        except (StructError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"max_lens: {exc}") from None
        try:
            b = _NO_BUDGET if budget is None else min(max(0, int(budget)), 1 << 62)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"budget: {exc}") from None
        if not isinstance(num_seqs or 0, int) or not 0 <= (num_seqs or 0) <= 1 << 31:
            raise ValueError(f"num_seqs must be an int in [0, 2^31], not {num_seqs!r}")
        pack.pack_into(self._params, 0, n, b, min_gain, num_seqs or 0, *ids, *lens)

    def _sync_curve(self) -> None:
        """Hands the config's cost model's curve to the core when the core's is not its
        current one (a new model, or `CostModel.version` moved; none: no cost threshold)."""
        model = self._config.cost_model
        if model is not self._curve_model or (model is not None and model.version != self._curve_version):
            self._set_curve(model)

    def _set_curve(self, model) -> None:
        """Hands the cost model's current curve to the core (None: no cost threshold)."""
        if model is None:
            self._check(self._lib.rhd_set_curve(self._handle, 0, 0, 0))
            self._curve_model, self._curve_version = None, None
            return
        curve = model.curve()
        xs = np.asarray(curve.num_tokens, dtype=np.float64)
        ys = np.asarray(curve.ms, dtype=np.float64)
        self._check(self._lib.rhd_set_curve(self._handle, xs.ctypes.data, ys.ctypes.data, xs.size))
        self._curve_model, self._curve_version = model, model.version

    def _set_stops(self, slot: int, stops) -> None:
        values = np.fromiter((t for t in stops if 0 <= t <= MAX_TOKEN), dtype=np.int32)
        self._check(self._lib.rhd_set_stops(self._handle, slot, _addr(values), values.size))
        self._slot_stops[slot] = stops

    def _set_stops_many(self, changed: list[tuple[int, frozenset[int]]]) -> None:
        """``_set_stops`` of several slots in one C call: a step's new requests (each one's
        first propose hands its stop set over) cost one crossing, not one each."""
        if len(changed) == 1:
            self._set_stops(*changed[0])
            return
        flat: list[int] = []
        offsets = [0]
        for _, stops in changed:
            flat.extend(t for t in stops if 0 <= t <= MAX_TOKEN)
            offsets.append(len(flat))
        slots = np.array([slot for slot, _ in changed], dtype=np.int32)
        ends = np.array(offsets, dtype=np.int64)
        values = np.array(flat, dtype=np.int32)
        self._check(self._lib.rhd_set_stops_many(self._handle, len(changed), _addr(slots), _addr(ends),
                                                 _addr(values)))
        cached = self._slot_stops
        for slot, stops in changed:
            cached[slot] = stops

    # -- accounting --------------------------------------------------------------------

    def memory_tokens(self, prompt_id: str) -> int:
        """Tokens indexed for the prompt (bounded by max_tokens_per_prompt)."""
        self.flush()
        handle = self._prompts.get(prompt_id)
        return self._check(self._lib.rhd_memory_tokens(self._handle, handle)) if handle else 0

    def memory_bytes(self, prompt_id: str) -> int:
        """Bytes the core holds for the prompt's index (capacity of its arrays)."""
        self.flush()
        handle = self._prompts.get(prompt_id)
        return self._check(self._lib.rhd_memory_bytes(self._handle, handle)) if handle else 0

    def global_tokens(self) -> int:
        self.flush()
        return self._check(self._lib.rhd_global_tokens(self._handle))

    def global_bytes(self) -> int:
        self.flush()
        return self._check(self._lib.rhd_global_bytes(self._handle))

    def stats(self) -> DrafterStats:
        self.flush()
        totals = (ctypes.c_int64 * 2)()
        self._check(self._lib.rhd_prompt_totals(self._handle, totals))
        s = self._stats
        return DrafterStats(int(s[2]), int(s[3]), int(s[4]), int(s[5]), int(totals[0]), int(totals[1]),
                            self.global_tokens())

    def gain_threshold(self, num_seqs: int, draft_per_seq: float, gain_per_seq: float) -> float:
        """`budget.gain_threshold` on the cost model's curve as the core computes it for a
        step (the tests hold it to the Python function); ValueError without a cost model."""
        if self._config.cost_model is None:
            raise ValueError("no cost model: drafts are not priced")
        self._sync_curve()
        out = ctypes.c_double()
        self._check(self._lib.rhd_gain_threshold(self._handle, num_seqs, draft_per_seq, gain_per_seq,
                                                 ctypes.addressof(out)))
        return out.value

    def slot_of(self, request_id: str) -> int:
        """The request's slot (its index in the core's arrays)."""
        slot = self._slots.get(request_id)
        if slot is None:
            raise UnknownRequestError(request_id)
        return slot
