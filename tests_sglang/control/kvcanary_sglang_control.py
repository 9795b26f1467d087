"""The SGLang tests' control plugin: lets a test that shares one engine with the others reach into
its scheduler process. Loaded through SGLang's plugin group when ``tests_sglang/control`` is on
``PYTHONPATH`` and ``KVCANARY_TEST_CONTROL`` names a directory; does nothing otherwise.

Before each ``Scheduler.run_batch`` (so before kvcanary's checks of that forward) it reads
``DIR/command.json`` when it changed: ``{"id": n, "mode": ..., "fault": {...}, "break": ...}``.
``mode`` switches the running canary's mode (the tests' one engine serves every mode; a user sets
KVCANARY_MODE at start). ``break`` names a piece of kvcanary to make fail (``None``: mend it;
:data:`BREAKABLE`). A ``fault`` is injected into the first batch it matches: the first row whose
prompt starts with ``prefix`` and that reads position ``position`` from the cache in this forward
(a radix-cache hit in an extend, or a decode; ``"decode": true`` waits for a decode), or the first
``repeat`` such batches. Its bytes and
table entries are restored after that batch's forward, so the engine the tests share is whole
again (what the engine did with them meanwhile, a request aborted or repaired, stays):

- ``flip``: every bit of one byte of that row's KV at ``position`` flips (``layer``, ``half``, ``byte``);
- ``shift``: the row's ``req_to_token`` entry at ``position`` holds the slot of ``position + 1``;
- ``late_write``: the K and V rows a request wrote last (``from_rid``'s last slot, which an abort left
  behind; default the row's slot of position 0) land in the row's slot of ``position``, every layer;
- ``free_referenced``: the slot of ``position``, which the radix cache still references, goes through
  the allocator's ``free`` (then leaves its free list again, so no other request is handed it);
- ``write_zeros``: in a decode, the cache write of ``layer`` lands zeros for the row's new token;
- ``attn_scale``: in a decode, the attention of every layer returns the row's output scaled by 1.5.

After each batch it writes ``DIR/state.json``: the last command applied, the faults injected (with
the forward they struck), the canary's stats, the requests it failed and the last slot each request
wrote.
"""

import json
import os
import traceback

# what ``break`` can make fail: (module, attribute, method name)
BREAKABLE = {
    "audit": ("kvcanary.engines.sglang.audit", "SglangAudit", "_run"),
    "steps": ("kvcanary.engines.sglang.entry", None, "build_step"),
    "stamps": ("kvcanary.canary", "Canary", "after_forward"),
    "heal": ("kvcanary.engines.sglang.heal", "Heal", "settle"),
}


def register():
    path = os.environ.get("KVCANARY_TEST_CONTROL")
    if not path:
        return
    from sglang.srt.managers.scheduler import Scheduler

    orig = Scheduler.run_batch
    ctl = Control(path)

    def run_batch(self, batch, *a, **k):
        undo = ctl.before(batch)
        try:
            return orig(self, batch, *a, **k)
        finally:
            ctl.after(undo)

    Scheduler.run_batch = run_batch


class Control:
    def __init__(self, path):
        self.path = path
        self.mtime = None
        self.command = {"id": None}
        self.fault = None
        self.injected = []
        self.errors = []
        self.last_slot = {}  # request id -> the last slot it wrote
        self.broken = {}  # name -> (owner, attribute, original)

    def adapter(self):
        from kvcanary.engines.sglang.entry import current

        return current()

    def before(self, batch):
        try:
            self._read()
            if batch is not None and batch.reqs and batch.out_cache_loc is not None:
                self._note_writes(batch)
            if self.fault is not None:
                return self._inject(batch)
        except Exception:
            self.errors.append(traceback.format_exc())
        return None

    def after(self, undo):
        try:
            if undo is not None:
                undo()
            self._write()
        except Exception:
            self.errors.append(traceback.format_exc())

    def _note_writes(self, batch):
        ends = batch.out_cache_loc.tolist()
        if batch.forward_mode.is_decode():
            last = ends
        else:
            cu, last = 0, []
            for n in batch.extend_lens:
                cu += n
                last.append(ends[cu - 1] if n else -1)
        for req, s in zip(batch.reqs, last):
            if s > 0:
                self.last_slot[req.rid] = s
        while len(self.last_slot) > 512:
            self.last_slot.pop(next(iter(self.last_slot)))

    def _read(self):
        f = os.path.join(self.path, "command.json")
        try:
            m = os.stat(f).st_mtime_ns
        except FileNotFoundError:
            return
        if m == self.mtime:
            return
        self.mtime = m
        with open(f) as fh:
            cmd = json.load(fh)
        if cmd.get("id") == self.command.get("id"):
            return
        self.command = cmd
        self.fault = cmd.get("fault")
        ad = self.adapter()
        if ad is not None and cmd.get("mode"):
            import dataclasses

            ad.config = dataclasses.replace(ad.config, mode=cmd["mode"])
            ad.heal.mode = cmd["mode"]
            if ad.canary is not None:
                ad.canary.config = dataclasses.replace(ad.canary.config, mode=cmd["mode"])
        if "break" in cmd:
            self._break(cmd["break"])

    def _break(self, name):
        import importlib

        for owner, attr, orig in self.broken.values():
            setattr(owner, attr, orig)
        self.broken.clear()
        if not name:
            return
        module, cls, attr = BREAKABLE[name]
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        orig = getattr(owner, attr)

        def broken(*a, **k):
            raise RuntimeError(f"kvcanary's {name} made to fail by the tests")

        setattr(owner, attr, broken)
        self.broken[name] = (owner, attr, orig)

    def _target(self, batch, fault):
        """The first row of ``batch`` whose prompt starts with the fault's prefix and that reads
        the fault's position from the cache in this forward."""
        prefix, p = fault["prefix"], fault["position"]
        decode = batch.forward_mode.is_decode()
        if fault.get("decode") and not decode:
            return None
        for i, req in enumerate(batch.reqs):
            if list(req.origin_input_ids[: len(prefix)]) != prefix:
                continue
            cached = int(batch.seq_lens_cpu[i]) - 1 if decode else int(batch.prefix_lens[i])
            if cached > p:
                return i, req
        return None

    def _inject(self, batch):
        ad = self.adapter()
        if ad is None or ad.runner is None or batch is None or not batch.reqs:
            return None
        hit = self._target(batch, self.fault)
        if hit is None:
            return None
        i, req = hit
        fault = self.fault
        self.fault = dict(fault, repeat=fault["repeat"] - 1) if fault.get("repeat", 1) > 1 else None
        table = batch.req_to_token_pool.req_to_token
        row, p = int(batch.req_pool_indices[i]), fault["position"]
        slot = int(table[row, p])
        record = dict(fault, rid=req.rid, slot=slot, forward=ad.forwards, command=self.command.get("id"))
        self.injected.append(record)
        kind = fault["kind"]
        if kind == "shift":
            table[row, p] = table[row, p + 1]

            def undo():
                table[row, p] = slot

            return undo
        pool = ad.runner.token_to_kv_pool
        if kind == "flip":
            return self._flip(pool, slot, fault)
        if kind == "late_write":
            source = self.last_slot.get(fault.get("from_rid"), int(table[row, 0]))
            record["source_slot"] = source
            return self._copy_rows(pool, source, slot)
        if kind == "free_referenced":
            return self._free(ad.allocator, slot)
        if kind == "write_zeros":
            record["slot"] = int(batch.out_cache_loc[i])
            return self._zero_write(pool, record["slot"], fault.get("layer", 0))
        if kind == "attn_scale":
            return self._scale_attention(ad.runner.attn_backend, i)
        raise ValueError(f"unknown fault kind {kind!r}")

    @staticmethod
    def _flip(pool, slot, fault):
        import torch

        buf = (pool.k_buffer if fault.get("half", "k") == "k" else pool.v_buffer)[fault.get("layer", 0)]
        view = buf[slot].view(-1).view(torch.uint8)
        b = fault.get("byte", 3)
        old = int(view[b])
        view[b] = old ^ 0xFF

        def undo():
            view[b] = old

        return undo

    @staticmethod
    def _copy_rows(pool, source, slot):
        saved = [(buf, buf[slot].clone()) for buf in (*pool.k_buffer, *pool.v_buffer)]
        for buf, _ in saved:
            buf[slot] = buf[source]

        def undo():
            for buf, old in saved:
                buf[slot] = old

        return undo

    @staticmethod
    def _free(allocator, slot):
        import torch

        allocator.free(torch.tensor([slot], dtype=torch.int64))
        # out of the free list again: the engine stays consistent, only the free was wrong
        for name in ("free_pages", "release_pages"):
            pages = getattr(allocator, name)
            setattr(allocator, name, pages[pages != slot])
        return None

    @staticmethod
    def _zero_write(pool, slot, layer):
        orig = pool.set_kv_buffer

        def set_kv_buffer(attn, loc, k, v, *a, **kw):
            out = orig(attn, loc, k, v, *a, **kw)
            if int(attn.layer_id) == layer:
                pool.k_buffer[layer][slot] = 0
                pool.v_buffer[layer][slot] = 0
            return out

        pool.set_kv_buffer = set_kv_buffer

        def undo():
            del pool.set_kv_buffer

        return undo

    @staticmethod
    def _scale_attention(backend, row):
        orig = backend._run_sdpa_forward_decode

        def run(query, output, *a, **kw):
            out = orig(query, output, *a, **kw)
            output[row] *= 1.5
            return out

        backend._run_sdpa_forward_decode = run

        def undo():
            del backend._run_sdpa_forward_decode

        return undo

    def _write(self):
        ad = self.adapter()
        state = {"command": self.command.get("id"), "injected": self.injected, "errors": self.errors[-3:],
                 "stats": ad.stats() if ad is not None else None,
                 "failed": dict(ad.failed) if ad is not None else {},
                 "mode": ad.config.mode if ad is not None else None,
                 "poisoned": sorted(ad.heal.poisoned) if ad is not None else [],
                 "last_slot": self.last_slot, "broken": sorted(self.broken)}
        tmp = os.path.join(self.path, "state.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh)
        os.replace(tmp, os.path.join(self.path, "state.json"))
