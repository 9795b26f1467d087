"""Each live request's real token stream, kept on the host for the canary's token checks (and
mirrored on a CUDA pool's device with only what changed sent each forward)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _sent(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` through pinned memory, without the host waiting (``device`` may be the
    CPU, where the tests keep a mirror)."""
    if device.type == "cpu":
        return host.clone()
    return host.pin_memory().to(device, non_blocking=True)


_RUN = 16  # a request's new tokens from this many on are written as one slice (a prompt, a prefill chunk)
_FEW = 64  # new tokens written one by one (a decode forward's), more by numpy's indexing


class TokenBook:
    """Every live request's real token stream, in one growing ``[rows, capacity]`` tensor (-1 pad).

    Each forward appends only the tokens not seen before, with one indexed write; rows of requests
    that left the cache are recycled. Reads and writes go through numpy (the buffer is on the host).
    A request's row holds its known tokens ``[0, have)`` and -1 from there on; row :attr:`BLANK` is
    all -1 (a step row whose request the book does not know reads it). A step reads the buffer in
    place (:attr:`kvcanary.step.Step.expected_rows`); :meth:`on` gives it on another device.
    """

    BLANK = 0

    def __init__(self) -> None:
        self.buf = torch.full((16, 256), -1, dtype=torch.int64)
        self._flat = self._flat_view(self.buf)
        self.row: dict[str, int] = {}
        self.have: dict[str, int] = {}
        self.calls = 0
        # the device copies of :attr:`buf`, and what was written since each was last brought up to date:
        # ``(rows, positions)`` index arrays, or None when the buffer itself was replaced
        self._mirrors: dict[torch.device, torch.Tensor] = {}
        self._dirty: list[tuple[np.ndarray, np.ndarray]] | None = []

    def streams(self, states: list[Any], upto: list[int], width: int) -> torch.Tensor:
        """int64 ``[len(states), width]``: request ``i``'s tokens ``[0, upto[i])``, then -1 (from
        transformers request states: ``request_id``, ``initial_tokens``, ``generated_tokens``)."""
        return self._window(self.update(states, upto, width), upto, width)

    def update(self, states: list[Any], upto: list[int], width: int = 0) -> list[int]:
        """Append each request's tokens up to ``upto[i]`` not seen before (from transformers request
        states), with room for ``width`` positions; returns each request's row of :attr:`buf`."""
        rows: list[int] = []
        vals: list[int] = []
        rr: list[int] = []
        pp: list[int] = []
        runs: list[tuple[int, int, list[int]]] = []  # (row, start, tokens) of a prompt or a long run
        row_of, have = self.row, self.have
        for st, u in zip(states, upto):
            rid = st.request_id
            r = row_of.get(rid)
            if r is None:
                r = self._row(rid)
            h = have[rid]
            if h < u:
                init = st.initial_tokens
                n0 = len(init)
                if h >= n0:  # a decoding request: generated tokens only
                    new = st.generated_tokens[h - n0 : u - n0]
                else:
                    new = init[h:u] + st.generated_tokens[: max(0, u - n0)]
                k = len(new)
                if k >= _RUN:
                    runs.append((r, h, new))
                else:
                    vals += new
                    rr += [r] * k
                    pp += range(h, h + k)
                have[rid] = h + k
            rows.append(r)
        self._write(rr, pp, vals, max(upto + [width]))
        self._write_runs(runs)
        return rows

    def extend(self, rid: str, start: int, tokens: list[int]) -> None:
        """Request ``rid``'s tokens from position ``start`` on (a stream's known tokens only grow)."""
        self.extend_all([(rid, start, tokens)])

    def extend_all(self, items: list[tuple[str, int, list[int]]]) -> None:
        """:meth:`extend` for each ``(rid, start, tokens)``, in one write."""
        rr: list[int] = []
        pp: list[int] = []
        vals: list[int] = []
        need = 0
        have = self.have
        runs: list[tuple[int, int, list[int]]] = []
        for rid, start, tokens in items:
            r = self.row.get(rid)
            if r is None:
                r = self._row(rid)
            k = len(tokens)
            if k >= _RUN:
                runs.append((r, start, tokens))
            else:
                rr += [r] * k
                pp += range(start, start + k)
                vals += tokens
            need = max(need, start + k)
            if have[rid] < start + k:
                have[rid] = start + k
        self._write(rr, pp, vals, need)
        self._write_runs(runs)

    def window(self, rids: list[str], upto: list[int], width: int) -> torch.Tensor:
        """int64 ``[len(rids), width]``: request ``i``'s known tokens ``[0, upto[i])``, then -1."""
        return self._window([self._row(rid) for rid in rids], upto, width)

    def _row(self, rid: str) -> int:
        r = self.row.get(rid)
        if r is None:
            r = self.row[rid] = self._free_row()
            self.have[rid] = 0
        return r

    def _write(self, rr: list[int], pp: list[int], vals: list[int], need: int) -> None:
        if need > self.buf.shape[1]:
            grown = torch.full((self.buf.shape[0], 2 * need), -1, dtype=torch.int64)
            grown[:, : self.buf.shape[1]] = self.buf
            self._replaced(grown)
        if len(vals) <= _FEW:  # a decode forward's: item by item, where numpy's indexing of lists costs tens
            flat, width = self._flat, self.buf.shape[1]  # of microseconds on caches the forward left cold
            for r, p, v in zip(rr, pp, vals):
                flat[r * width + p] = v
        else:  # numpy indexing: a few microseconds where torch ops on small lists cost tens
            self.buf.numpy()[rr, pp] = vals
        if vals:
            if self._mirrors:  # no index arrays made on a CPU pool's path
                self._touched(np.asarray(rr, dtype=np.int64), np.asarray(pp, dtype=np.int64))

    def _write_runs(self, runs: list[tuple[int, int, list[int]]]) -> None:
        """Each run's tokens into its row with one slice assignment (the buffer is already wide
        enough: :meth:`_write` grew it)."""
        if runs:
            b = self.buf.numpy()
            for r, start, tokens in runs:
                b[r, start : start + len(tokens)] = tokens
                if self._mirrors:
                    self._touched(np.full(len(tokens), r, dtype=np.int64), np.arange(start, start + len(tokens)))

    def _replaced(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self._flat = self._flat_view(buf)
        self._dirty = None

    @staticmethod
    def _flat_view(buf: torch.Tensor) -> memoryview:
        """``buf``'s memory as one flat run of int64 items (row ``r``, position ``p``: item ``r *
        width + p``), for writes of a few tokens."""
        array: Any = buf.numpy()  # numpy arrays are buffers; its stubs do not say so
        return memoryview(array).cast("B").cast("q")

    def _touched(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Remember entries written, for the device copies (callers skip making the index arrays
        where there is none)."""
        if self._dirty is not None:
            self._dirty.append((rows, positions))

    def on(self, device: torch.device | str) -> torch.Tensor:
        """:attr:`buf` on ``device``: the buffer itself on the CPU; elsewhere a copy kept up to date
        by sending only the entries written since its last use (a forward's new tokens: the host
        part sized by requests, not by positions), or the whole buffer after it grew."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.buf
        return self._synced(device)

    def _synced(self, device: torch.device) -> torch.Tensor:
        m = self._mirrors.get(device)
        if m is None or self._dirty is None or m.shape != self.buf.shape:
            for d in list(self._mirrors):  # every mirror is rebuilt from the buffer as it now is
                del self._mirrors[d]
            m = self._mirrors[device] = _sent(self.buf.clone(), device)
        elif self._dirty:
            rows = np.concatenate([r for r, _ in self._dirty])
            pos = np.concatenate([p for _, p in self._dirty])
            # rows, positions and the values as they are now (an entry written twice sends its last
            # value twice) in one transfer
            sent = _sent(torch.from_numpy(np.stack([rows, pos, self.buf.numpy()[rows, pos]])), device)
            m[sent[0], sent[1]] = sent[2]
        self._dirty = []
        return m

    def _window(self, rows: list[int], upto: list[int], width: int) -> torch.Tensor:
        if width > self.buf.shape[1]:
            self._write([], [], [], width)
        out = self.buf.numpy()[rows, :width]  # a copy (fancy indexing)
        out[np.arange(width)[None, :] >= np.asarray(upto)[:, None]] = -1
        return torch.from_numpy(out)

    def _free_row(self) -> int:
        used = set(self.row.values())
        used.add(self.BLANK)
        r = next((i for i in range(self.buf.shape[0]) if i not in used), None)
        if r is None:
            r = self.buf.shape[0]
            self._replaced(torch.cat([self.buf, torch.full_like(self.buf, -1)]))
        have = self.buf.numpy()[r]
        stale = np.flatnonzero(have != -1)
        if stale.size:  # a recycled row: only what its last request wrote is cleared
            have[stale] = -1
            if self._mirrors:
                self._touched(np.full(stale.size, r, dtype=np.int64), stale.astype(np.int64))
        return r

    def forget(self, rid: str) -> None:
        """Drop one request's stream (it finished)."""
        self.row.pop(rid, None)
        self.have.pop(rid, None)

    def forget_except(self, live: set[str]) -> None:
        """Drop the streams of requests that are no longer live."""
        for rid in [k for k in self.row if k not in live]:
            del self.row[rid], self.have[rid]
