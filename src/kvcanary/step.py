"""Steps: what one forward pass reads from and writes to the KV cache.

A step has ``R`` rows (requests, padding rows included) and ``T`` new tokens. Row ``r`` reads the
positions ``[read_starts[r], cached_lens[r])`` of its sequence through its slot table, and writes
the new tokens ``new_offsets[r] : new_offsets[r+1]``. The slot of position ``p`` of row ``r`` is

* token table: ``slot_table[table_rows[r], p]`` (SGLang's ``req_to_token``);
* block table: ``block_table[table_rows[r], p // block_size] * block_size + p % block_size``
  (vLLM, transformers).

Padding is explicit: a row with ``row_valid[r] == False`` reads and writes nothing, and a new
token whose slot is negative is a padding token that is not written.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvcanary.errors import StepError

_INT_DTYPES = (torch.int32, torch.int64)
# = canary_args.MAX_SLOTS: no pool reaches it, and a table entry at most this / block_size times
# block_size, plus an in-block offset, still fits int64
_SLOT_LIMIT = 1 << 62


@dataclass
class Step:
    """One forward pass's metadata; every tensor on the pool's device.

    Parameters
    ----------
    cached_lens : int ``[R]`` tokens already in the cache (read this step)
    new_offsets : int ``[R + 1]`` cumulative new-token counts, ``new_offsets[0] == 0``
    new_tokens, new_positions, new_slots : int ``[T]`` the tokens written this step; slot < 0 is padding
    slot_table : int ``[num_table_rows, max_len]`` token-to-slot table, or
    block_table : int ``[num_table_rows, max_blocks]`` with ``block_size``
    table_rows : int ``[R]`` which table row each step row uses (default: row ``r`` uses row ``r``)
    read_starts : int ``[R]`` first position the attention reads (sliding windows; default 0)
    row_valid : bool ``[R]`` False marks a padding row (default: all valid)
    expected_tokens : int ``[num_expected_rows, max_len]`` the request's real token at each position,
        -1 where unknown (positions past a row's ``cached_len`` plus its new tokens are not consulted)
    expected_rows : int ``[R]`` which row of ``expected_tokens`` each step row uses (default: row ``r``
        uses row ``r``): an engine's token record read in place, without a per-step copy
    expected_new_tokens, expected_new_positions : int ``[T]`` write-input assertion streams (a token of
        -1 is not known yet and not checked)
    written_from : int ``[R]`` the first position of row ``r``'s reads whose slots this same step writes
        (another row of the batch computes them in this forward, as when an engine hands out a
        prefix-cache hit before its KV exists); reads of positions ``>= written_from[r]`` are
        verified after this step's writes are stamped, the others before the forward
    """

    cached_lens: torch.Tensor
    new_offsets: torch.Tensor
    new_tokens: torch.Tensor
    new_positions: torch.Tensor
    new_slots: torch.Tensor
    slot_table: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    block_size: int = 1
    table_rows: torch.Tensor | None = None
    read_starts: torch.Tensor | None = None
    row_valid: torch.Tensor | None = None
    expected_tokens: torch.Tensor | None = None
    expected_rows: torch.Tensor | None = None
    expected_new_tokens: torch.Tensor | None = None
    expected_new_positions: torch.Tensor | None = None
    written_from: torch.Tensor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop("_memo", None)  # a field assigned anew: the cached shape check and descriptor go
        object.__setattr__(self, name, value)

    def assign_new(self, name: str, value: torch.Tensor | None) -> None:
        """Assign ``expected_new_tokens`` or ``expected_new_positions`` (``name``) while the step is in
        use: where ``value`` passes that field's shape check (1-d, ``num_new`` integers on the step's
        device), or is ``None`` (the field cleared), what the canary cached about the step stays, the
        field named in its memo as changed (the fused path's descriptor remakes that field's entries
        on its next use); any other value is assigned as any field is (the memo goes, every check
        runs again)."""
        if name not in ("expected_new_tokens", "expected_new_positions"):
            raise StepError(f"assign_new: expected expected_new_tokens or expected_new_positions, got {name!r}")
        memo = self.__dict__.get("_memo")
        if memo is not None and value is None:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, None)
                memo.setdefault("changed", set()).add(name)
            return
        if (memo is None or not isinstance(value, torch.Tensor) or value.dtype not in _INT_DTYPES
                or value.device != self.cached_lens.device or tuple(value.shape) != (self.num_new,)):
            setattr(self, name, value)
            return
        object.__setattr__(self, name, value)
        memo.setdefault("changed", set()).add(name)

    def memo(self) -> dict[str, Any]:
        """What the canary caches about this step between its calls: the passed shape check and the
        fused path's descriptor of the tensors. Assigning any field drops it; writing a tensor's
        values in place keeps it (values are checked every call); resizing a step's tensor in place
        (``resize_``, ``set_``) after the canary has seen the step is not supported: assign a new
        tensor instead."""
        m = self.__dict__.get("_memo")
        if m is None:
            m = self.__dict__["_memo"] = {}
        return m  # type: ignore[no-any-return]

    @property
    def num_rows(self) -> int:
        return int(self.cached_lens.shape[0])

    @property
    def num_new(self) -> int:
        return int(self.new_tokens.shape[0])

    @property
    def table(self) -> torch.Tensor:
        t = self.slot_table if self.slot_table is not None else self.block_table
        assert t is not None
        return t

    @property
    def table_span(self) -> int:
        """Positions one table row can address."""
        if self.slot_table is not None:
            return int(self.slot_table.shape[1])
        return int(self.table.shape[1]) * self.block_size

    def validate_shapes(self) -> None:
        """Check kinds, dtypes, shapes and devices (no value reads: safe under graph capture); once
        per step object until a field is assigned (:meth:`memo`)."""
        memo = self.memo()
        if memo.get("shapes_ok"):
            return
        self._validate_shapes()
        memo["shapes_ok"] = True

    def _validate_shapes(self) -> None:
        for name in _TENSOR_FIELDS:  # kinds first: the shape checks below read .shape and .device
            v = getattr(self, name)
            if v is not None and not isinstance(v, torch.Tensor):
                raise StepError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
        if (self.slot_table is None) == (self.block_table is None):
            raise StepError("a step needs exactly one of slot_table or block_table")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise StepError(f"block_size: expected an int, got {type(self.block_size).__name__} {self.block_size!r}")
        if self.block_size < 1:
            raise StepError(f"block_size must be >= 1, got {self.block_size}")
        if self.slot_table is not None and self.block_size != 1:
            raise StepError(f"block_size applies to block tables only; got {self.block_size} with a slot_table")
        r, t = self.num_rows, self.num_new
        dev = self.cached_lens.device
        expect: dict[str, tuple[int, ...] | None] = {
            "cached_lens": (r,),
            "new_offsets": (r + 1,),
            "new_tokens": (t,),
            "new_positions": (t,),
            "new_slots": (t,),
            "table_rows": (r,),
            "read_starts": (r,),
            "row_valid": (r,),
            "expected_rows": (r,),
            "expected_new_tokens": (t,),
            "expected_new_positions": (t,),
            "written_from": (r,),
            "slot_table": None,
            "block_table": None,
            "expected_tokens": None,
        }
        for name, shape in expect.items():
            v = getattr(self, name)
            if v is None:
                continue
            want_dtype = (torch.bool,) if name == "row_valid" else _INT_DTYPES
            if v.dtype not in want_dtype:
                raise StepError(f"{name}: expected dtype {' or '.join(map(str, want_dtype))}, got {v.dtype}")
            if v.device != dev:
                raise StepError(f"{name}: expected device {dev} (that of cached_lens), got {v.device}")
            if shape is None:
                if v.dim() != 2:
                    raise StepError(f"{name}: expected 2 dims, got shape {tuple(v.shape)}")
            elif tuple(v.shape) != shape:
                raise StepError(f"{name}: expected shape {shape}, got {tuple(v.shape)}")
        if self.expected_rows is not None and self.expected_tokens is None:
            raise StepError("expected_rows: given without expected_tokens")
        if self.expected_tokens is not None and self.expected_rows is None and self.expected_tokens.shape[0] != r:
            raise StepError(f"expected_tokens: expected {r} rows, got {self.expected_tokens.shape[0]} "
                            "(pass expected_rows to read other rows)")
        if self.table_rows is None and self.table.shape[0] < r:
            raise StepError(f"table has {self.table.shape[0]} rows for a step of {r} rows; pass table_rows")

    def validate_values(self, num_slots: int) -> None:
        """Check value ranges (reads tensors: CPU path and eager use only)."""
        counts = self.new_offsets[1:] - self.new_offsets[:-1]
        _check(self.new_offsets[:1] == 0, "new_offsets[0]", self.new_offsets[:1], "0")
        _check(counts >= 0, "new_offsets increments", counts, "non-decreasing")
        _check(self.new_offsets[-1:] == self.num_new, "new_offsets[-1]", self.new_offsets[-1:], f"{self.num_new} (T)")
        _check(self.cached_lens >= 0, "cached_lens", self.cached_lens, ">= 0")
        valid = self.valid_rows()
        span = self.cached_lens + counts
        _check((span <= self.table_span) | ~valid, "cached_lens + new tokens", span, f"<= table span {self.table_span}")
        if self.read_starts is not None:
            rs = self.read_starts
            _check((rs >= 0) & (rs <= self.cached_lens), "read_starts", rs, "in [0, cached_lens]")
            # the first new token chains from position cached_len - 1, which must be readable
            ok = (rs < self.cached_lens) | (self.cached_lens == 0) | (counts == 0) | ~valid
            _check(ok, "read_starts", rs, "< cached_lens when a row appends tokens")
        if self.table_rows is not None:
            _check((self.table_rows >= 0) & (self.table_rows < self.table.shape[0]), "table_rows",
                   self.table_rows, f"in [0, {self.table.shape[0]})")
        if self.expected_rows is not None:
            assert self.expected_tokens is not None
            n = self.expected_tokens.shape[0]
            _check((self.expected_rows >= 0) & (self.expected_rows < n), "expected_rows", self.expected_rows,
                   f"in [0, {n})")
        if self.block_table is not None:
            self._check_blocks(num_slots, valid, span)
        _check(self.new_slots < num_slots, "new_slots", self.new_slots, f"< num_slots {num_slots}")
        _check(self.new_positions >= 0, "new_positions", self.new_positions, ">= 0")

    def _check_blocks(self, num_slots: int, valid: torch.Tensor, ends: torch.Tensor) -> None:
        """Every block table entry a valid row addresses (its positions ``read_starts .. ends - 1``)
        must map the positions used in it to slots in ``[0, num_slots)``. The bound is on the entry
        itself, so an entry whose product with ``block_size`` wraps int64 cannot pass."""
        assert self.block_table is not None
        bs, width = self.block_size, self.block_table.shape[1]
        rows = torch.arange(self.num_rows, device=ends.device)
        trow = rows if self.table_rows is None else self.table_rows.long()
        entry = self.block_table.long()[trow]  # [R, width]
        first = torch.arange(width, device=ends.device) * bs  # first position of each block column
        lo, hi = self.starts()[:, None], ends.long()[:, None]
        used = valid[:, None] & (first < hi) & (first + bs > lo)
        last_off = torch.minimum(hi, first + bs) - 1 - first  # the largest in-block offset used
        limit = torch.div(num_slots - 1 - last_off, bs, rounding_mode="floor")
        bad = (used & ((entry < 0) | (entry > limit))).nonzero()
        if bad.numel():
            r, c = (int(x) for x in bad[0])
            raise StepError(
                f"block_table[{int(trow[r])}, {c}] (step row {r}): expected a block in [0, {int(limit[r, c])}], "
                f"whose slots stay below num_slots {num_slots} with block_size {bs}, got {int(entry[r, c])}"
            )

    def validate_once(self, num_slots: int) -> None:
        """:meth:`validate_values`, skipped when this step already passed for ``num_slots`` and none
        of its tensors was replaced, resized or written in place since (engines refill persistent
        buffers in place: torch bumps a tensor's ``_version`` on every in-place write). Writes torch
        cannot see (through ``.data``, DLPack, a custom kernel) and inference-mode tensors, which
        have no version counter, are not tracked: a step holding one is validated every call.
        Call after :meth:`validate_shapes`."""
        key = self._memo_key(num_slots)
        memo = self.__dict__.get("_validated_memo")
        if key is not None and memo is not None and _same_key(memo, key):
            return
        self.validate_values(num_slots)
        self.__dict__["_validated_memo"] = key

    def _memo_key(self, num_slots: int) -> list[Any] | None:
        key: list[Any] = [num_slots, self.block_size]
        for name in _TENSOR_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor):
                key.append(None)
                continue
            if v.is_inference():
                return None
            # the weak reference tells a replaced tensor from the validated one even where the new
            # one got the old one's id and memory
            key.append((weakref.ref(v), v._version, v.data_ptr(), v.shape, v.stride(), v.dtype, v.device))
        return key

    def valid_rows(self) -> torch.Tensor:
        if self.row_valid is None:
            return torch.ones(self.num_rows, dtype=torch.bool, device=self.cached_lens.device)
        return self.row_valid

    def split_reads(self) -> tuple["Step", "Step | None"]:
        """The reads to verify before the forward, and those to verify after its writes are
        stamped (``None`` when the step has no ``written_from``): the same step over
        ``[read_start, e)`` and ``[e, cached_len)`` with ``e = clamp(written_from, read_start,
        cached_len)``. Built with device ops only (no host sync)."""
        if self.written_from is None:
            return self, None
        start, cached = self.starts(), self.cached_lens.long()
        e = torch.minimum(torch.maximum(self.written_from.long(), start), cached)
        before = dataclasses.replace(self, cached_lens=e, written_from=None)
        after = dataclasses.replace(self, read_starts=e, written_from=None)
        return before, after

    def starts(self) -> torch.Tensor:
        if self.read_starts is None:
            return torch.zeros_like(self.cached_lens, dtype=torch.int64)
        return self.read_starts.long()

    def lookup(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` in step ``rows`` (both int64 ``[n]``), int64 ``[n]``.

        Positions outside the table map to -1, and so do block table entries too large in
        magnitude to address a slot (``|entry| * block_size > 2**62``): their product with
        ``block_size`` could wrap int64 onto a real slot.
        """
        trow = rows if self.table_rows is None else self.table_rows.long()[rows]
        p = positions.clamp(0, self.table_span - 1)
        inside = p == positions
        if self.slot_table is not None:
            s = self.slot_table[trow, p].long()
        else:
            bs = self.block_size
            e = self.table[trow, torch.div(p, bs, rounding_mode="floor")].long()
            lim = _SLOT_LIMIT // bs
            inside &= (e >= -lim) & (e <= lim)
            s = e.clamp(-lim, lim) * bs + p % bs
        return torch.where(inside, s, -1)

    def expected_row_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``expected_tokens`` that step ``rows`` read."""
        return rows if self.expected_rows is None else self.expected_rows.long()[rows]


_TENSOR_FIELDS = tuple(f.name for f in fields(Step) if f.name != "block_size")


def _same_key(a: list[Any], b: list[Any]) -> bool:
    """Whether two memo keys describe the same tensors in the same state."""
    for x, y in zip(a, b):
        if isinstance(x, tuple) and isinstance(y, tuple):
            if x[0]() is None or x[0]() is not y[0]() or x[1:] != y[1:]:
                return False
        elif x != y:
            return False
    return len(a) == len(b)


def _check(ok: torch.Tensor, name: str, values: torch.Tensor, expected: str) -> None:
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    if bad.numel():
        i = tuple(int(x) for x in bad[0])
        idx = i[0] if len(i) == 1 else i
        raise StepError(f"{name}: expected {expected}, got {values[i].item()} at index {idx}")
