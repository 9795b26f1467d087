"""The SGLang tests' control plugin: lets a test that shares one engine with the others reach into
its scheduler process. Loaded through SGLang's plugin group when ``tests_sglang/control`` is on
``PYTHONPATH`` and ``KVCANARY_TEST_CONTROL`` names a directory; does nothing otherwise.

Before each ``Scheduler.run_batch`` (so before kvcanary's checks of that forward) it reads
``DIR/command.json`` when it changed: ``{"id": n, "mode": ..., "fault": {...}}``. ``mode`` switches
the running canary's mode (the tests' one engine serves every mode; a user sets KVCANARY_MODE at
start). A ``fault`` is injected into the first batch it matches and undone after that batch's
forward, so the engine's own state is whole again for the tests that follow:

- ``{"kind": "flip", "prefix": [...], "position": p, "layer": l, "half": "k"}``: flip every bit of
  one byte of the KV at position ``p`` of a request whose prompt starts with ``prefix`` and that
  reads ``p`` from the cache in this forward (a radix-cache hit in an extend, or a decode);
- ``{"kind": "shift", "prefix": [...], "position": p}``: that request's ``req_to_token`` entry at
  ``p`` off by one position (it holds the slot of ``p + 1``) for the forward.

After each batch it writes ``DIR/state.json``: the last command applied, the faults injected (with
the forward they struck), the canary's stats and the requests it failed.
"""

import json
import os
import traceback


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

    def adapter(self):
        from kvcanary.engines.sglang.entry import current

        return current()

    def before(self, batch):
        try:
            self._read()
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
            if ad.canary is not None:
                ad.canary.config = dataclasses.replace(ad.canary.config, mode=cmd["mode"])

    def _target(self, batch, fault):
        """The first row of ``batch`` whose prompt starts with the fault's prefix and that reads
        the fault's position from the cache in this forward."""
        prefix, p = fault["prefix"], fault["position"]
        decode = batch.forward_mode.is_decode()
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
        fault, self.fault = self.fault, None
        table = batch.req_to_token_pool.req_to_token
        row, p = int(batch.req_pool_indices[i]), fault["position"]
        slot = int(table[row, p])
        record = dict(fault, rid=req.rid, slot=slot, forward=ad.forwards, command=self.command.get("id"))
        self.injected.append(record)
        if fault["kind"] == "shift":
            table[row, p] = table[row, p + 1]

            def undo():
                table[row, p] = slot

            return undo
        pool = ad.runner.token_to_kv_pool
        buf = (pool.k_buffer if fault.get("half", "k") == "k" else pool.v_buffer)[fault.get("layer", 0)]
        view = buf[slot].view(-1).view(__import__("torch").uint8)
        b = fault.get("byte", 3)
        old = int(view[b])
        view[b] = old ^ 0xFF

        def undo():
            view[b] = old

        return undo

    def _write(self):
        ad = self.adapter()
        state = {"command": self.command.get("id"), "injected": self.injected, "errors": self.errors[-3:],
                 "stats": ad.stats() if ad is not None else None,
                 "failed": dict(ad.failed) if ad is not None else {},
                 "mode": ad.config.mode if ad is not None else None}
        tmp = os.path.join(self.path, "state.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh)
        os.replace(tmp, os.path.join(self.path, "state.json"))
