"""A research probe for kvcanary's SGLang adapter: an SGLang general plugin (entry point group
``sglang.srt.plugins``) that wraps the methods an adapter would hook and writes what they see, one
JSON object a line, to the file named by KVCSG_PROBE_LOG (each process appends its own lines).

It is found through PYTHONPATH=tests_sglang/probe (its dist-info folder carries the entry point), so
it is never installed; tests_sglang/probe_run.py drives it. Records are kept small: tensors are
summarised (shape, dtype, and values when short)."""

import functools
import json
import multiprocessing
import os
import sys
import threading
import time

_LOCK = threading.Lock()
_COUNTS = {}
LIMIT = int(os.environ.get("KVCSG_PROBE_LIMIT", "6"))  # records per hook point per process


def _t(x, n=24):
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        d = {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""), "device": str(x.device)}
        if x.numel() <= n and x.dtype != torch.bool and not x.is_floating_point():
            d["values"] = x.tolist()
        return d
    if isinstance(x, (list, tuple)) and len(x) <= n and all(isinstance(v, int) for v in x):
        return list(x)
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return type(x).__name__


def log(kind, **fields):
    path = os.environ.get("KVCSG_PROBE_LOG")
    if not path:
        return
    with _LOCK:
        c = _COUNTS.get(kind, 0)
        _COUNTS[kind] = c + 1
        if c >= LIMIT and kind not in ("modules",):
            return
        rec = {"kind": kind, "n": c, "pid": os.getpid(), "ppid": os.getppid(),
               "proc": multiprocessing.current_process().name, "thread": threading.current_thread().name,
               "t": round(time.time(), 3), **fields}
        with open(path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


def wrap(cls, name, before=None, after=None):
    orig = getattr(cls, name)
    if getattr(orig, "_kvcanary_probe", False):
        return

    @functools.wraps(orig)
    def w(*args, **kwargs):
        if before is not None:
            try:
                before(*args, **kwargs)
            except Exception as e:  # a probe never breaks the engine
                log("probe_error", where=f"{cls.__name__}.{name} before", error=repr(e))
        out = orig(*args, **kwargs)
        if after is not None:
            try:
                after(out, *args, **kwargs)
            except Exception as e:
                log("probe_error", where=f"{cls.__name__}.{name} after", error=repr(e))
        return out

    w._kvcanary_probe = True
    setattr(cls, name, w)


def _batch(fb):
    return {f: _t(getattr(fb, f, None)) for f in (
        "forward_mode", "batch_size", "input_ids", "positions", "req_pool_indices", "seq_lens",
        "seq_lens_cpu", "extend_prefix_lens", "extend_seq_lens", "extend_prefix_lens_cpu",
        "extend_seq_lens_cpu", "extend_start_loc", "out_cache_loc", "out_cache_loc_is_physical")} | {
        "forward_mode": str(getattr(fb, "forward_mode", None)), "fb_id": id(fb),
        "out_cache_loc_ptr": fb.out_cache_loc.data_ptr() if getattr(fb, "out_cache_loc", None) is not None else None,
        "rids": (fb.rids[:4] if getattr(fb, "rids", None) else None)}


def _runner_forward(self, forward_batch, *a, **k):
    pool = self.token_to_kv_pool
    r2t = self.req_to_token_pool.req_to_token
    rows = {}
    for i, rpi in enumerate(forward_batch.req_pool_indices.tolist()[:4]):
        sl = int(forward_batch.seq_lens[i])
        rows[str(rpi)] = r2t[rpi, :sl].tolist()[:64]
    info = {}
    if not _COUNTS.get("runner_static"):
        kb = getattr(pool, "k_buffer", None)
        info = {
            "runner": type(self).__name__, "module": type(self).__module__,
            "is_draft_worker": self.is_draft_worker, "device": self.device,
            "attn_backend": type(self.attn_backend).__name__,
            "req_to_token_pool": type(self.req_to_token_pool).__name__,
            "req_to_token": _t(r2t), "req_to_token_pool_size": self.req_to_token_pool.size,
            "token_to_kv_pool": type(pool).__name__, "pool_mro": [c.__name__ for c in type(pool).__mro__][:6],
            "pool_size": getattr(pool, "size", None), "page_size": getattr(pool, "page_size", None),
            "pool_dtype": str(getattr(pool, "dtype", None)), "store_dtype": str(getattr(pool, "store_dtype", None)),
            "layer_num": getattr(pool, "layer_num", None), "start_layer": getattr(pool, "start_layer", None),
            "kv_cache_layout": getattr(pool, "kv_cache_layout", None),
            "k_buffer_type": type(kb).__name__, "k_buffer_len": len(kb) if kb is not None else None,
            "k_buffer0": _t(kb[0]) if kb else None, "v_buffer0": _t(pool.v_buffer[0]) if kb else None,
            "k_buffer0_contiguous": kb[0].is_contiguous() if kb else None,
            "allocator": type(getattr(self, "token_to_kv_pool_allocator", None)).__name__,
            "max_total_num_tokens": getattr(self, "max_total_num_tokens", None),
            "sliding_window_size": getattr(self, "sliding_window_size", None),
            "canary_manager": repr(getattr(self, "canary_manager", "absent")),
            "model_forward": getattr(self.model.forward, "__qualname__", None),
            "server_page_size": getattr(self.server_args, "page_size", None),
            "eager_runner": type(getattr(self, "eager_runner", None)).__name__,
        }
        log("runner_static", **info)
    log("runner_forward", **_batch(forward_batch), req_to_token_rows=rows,
        slot0_k_abs_sum=float(pool.k_buffer[0][0].abs().sum()) if getattr(pool, "k_buffer", None) else None)
    if forward_batch.forward_mode.is_decode() and not _COUNTS.get("modules"):
        _dump_modules()


def _attn(mode):
    def before(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        log(f"attn_{mode}", backend=type(self).__name__, layer_id=layer.layer_id, q=_t(q), k=_t(k), v=_t(v),
            save_kv_cache=save_kv_cache, tp_q_head_num=layer.tp_q_head_num, tp_k_head_num=layer.tp_k_head_num,
            qk_head_dim=layer.qk_head_dim, v_head_dim=layer.v_head_dim,
            sliding_window_size=layer.sliding_window_size, fb=_batch(forward_batch))
    return before


def _set_kv(self, layer, loc_info, cache_k, cache_v, *a, **k):
    loc = getattr(loc_info, "loc", loc_info)
    log("set_kv_buffer", pool=type(self).__name__, layer_id=getattr(layer, "layer_id", None),
        loc_info=type(loc_info).__name__, loc=_t(loc), swa_loc=_t(getattr(loc_info, "swa_loc", None)),
        physical=getattr(loc_info, "physical", None), cache_k=_t(cache_k), cache_v=_t(cache_v),
        k_contiguous=cache_k.is_contiguous())


def _req(r):
    kv = getattr(r, "kv", None)
    return {"rid": r.rid, "origin_input_ids": _t(list(r.origin_input_ids), 64), "output_ids": _t(list(r.output_ids), 64),
            "full_untruncated_fill_ids_len": len(getattr(r, "full_untruncated_fill_ids", ()) or ()),
            "req_pool_idx": getattr(kv, "req_pool_idx", None),
            "kv": {f: getattr(kv, f, None) for f in ("kv_committed_len", "kv_allocated_len", "cache_protected_len",
                                                     "cache_inserted_len")},
            "prefix_len": getattr(r, "prefix_len", None), "extend_end": getattr(r, "extend_end", None),
            "finished": r.finished(), "finished_reason": type(getattr(r, "finished_reason", None)).__name__}


def _dump_modules():
    import importlib.metadata as md
    top = sorted({m.split(".")[0] for m in list(sys.modules) if not m.startswith("_")})
    dists = md.packages_distributions()
    used = sorted({d for m in top for d in dists.get(m, [])})
    log("modules", top_level=top, distributions=used)


def _torch_shims():
    """To see how far SGLang's own kv-canary gets on a CPU (KVCSG_PROBE_TORCH_SHIMS=1): torch's CPU
    stream takes no ``device`` argument and a CPU-only torch has no pinned memory; both are made to
    behave as on an accelerator (a stream object, ordinary memory). SGLang itself is not changed."""
    import torch

    cls = torch.cpu.Stream
    if not getattr(cls, "_kvcsg_shim", False):
        class Stream(cls):
            _kvcsg_shim = True

            def __init__(self, priority=-1, device=None, **kw):
                super().__init__(priority=priority)
                self.device = torch.device("cpu")
        torch.cpu.Stream = Stream
    for name in ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like"):
        f = getattr(torch, name)
        if getattr(f, "_kvcsg_shim", False):
            continue

        def make(f):
            def g(*a, pin_memory=False, **k):
                return f(*a, **k)
            g._kvcsg_shim = True
            return g
        setattr(torch, name, make(f))
    log("torch_shims", stream=True, pin_memory=True)


def register():
    log("plugin_loaded", argv=sys.argv[:3], main=getattr(sys.modules.get("__main__"), "__file__", None),
        start_method=multiprocessing.get_start_method(allow_none=True))
    # class-level patches, applied in every process that loads plugins (engine, scheduler, detokenizer)
    import importlib

    def later(modname, fn):
        try:
            mod = importlib.import_module(modname)
        except Exception as e:
            log("probe_error", where=f"import {modname}", error=repr(e))
            return
        fn(mod)

    if os.environ.get("KVCSG_PROBE_TORCH_SHIMS"):
        _torch_shims()
    if multiprocessing.current_process().name == "MainProcess" and not os.environ.get("KVCSG_PROBE_IN_MAIN"):
        return  # the engine's own process: nothing to hook there
    later("sglang.srt.model_executor.model_runner",
          lambda m: wrap(m.ModelRunner, "forward", before=_runner_forward))
    later("sglang.srt.layers.attention.torch_native_backend", lambda m: (
        wrap(m.TorchNativeAttnBackend, "forward_extend", before=_attn("extend")),
        wrap(m.TorchNativeAttnBackend, "forward_decode", before=_attn("decode"))))
    later("sglang.srt.mem_cache.memory_pool", lambda m: wrap(m.MHATokenToKVPool, "set_kv_buffer", before=_set_kv))

    def key_ids(key):
        return _t(list(getattr(key, "token_ids", None) or []), 64)

    def cache_hooks(m):
        cls = m.UnifiedRadixCache
        wrap(cls, "match_prefix", after=lambda out, self, params, *a, **k: log(
            "match_prefix", cls=type(self).__name__, key=key_ids(getattr(params, "key", None)),
            device_indices=_t(getattr(out, "device_indices", None), 64), result=type(out).__name__))
        wrap(cls, "insert", after=lambda out, self, params, *a, **k: log(
            "insert", cls=type(self).__name__, key=key_ids(getattr(params, "key", None)),
            value=_t(getattr(params, "value", None), 64), prev_prefix_len=getattr(params, "prev_prefix_len", None),
            result=str(out)[:300]))
        wrap(cls, "evict", after=lambda out, self, params, *a, **k: log(
            "evict", cls=type(self).__name__, params=str(params)[:300], result=str(out)[:300]))
        wrap(cls, "evict_for_alloc", after=lambda out, self, params, *a, **k: log(
            "evict_for_alloc", cls=type(self).__name__, params=str(params)[:300], result=str(out)[:300]))
        wrap(cls, "_evict", after=lambda out, self, params, *a, **k: log(
            "_evict", cls=type(self).__name__, params=str(params)[:300], result=str(out)[:300]))
        wrap(cls, "checkpoint", before=lambda self, req, *, up_to, **k: log(
            "checkpoint", req=_req(req), up_to=up_to))
        wrap(cls, "free_kv_row", before=lambda self, kv, ranges: log(
            "free_kv_row", req_pool_idx=getattr(kv, "req_pool_idx", None), ranges=str(ranges)))
        wrap(cls, "on_release", before=lambda self, req, *, checkpointed: log(
            "on_release", req=_req(req), checkpointed=checkpointed))
    later("sglang.srt.mem_cache.unified_radix_cache", cache_hooks)
    later("sglang.srt.mem_cache.allocator.token", lambda m: wrap(
        m.TokenToKVPoolAllocator, "free", before=lambda self, idx: log(
            "allocator_free", cls=type(self).__name__, index=_t(idx, 64),
            in_free_group=self.free_group is not None)))
    later("sglang.srt.managers.scheduler", lambda m: wrap(m.Scheduler, "run_batch", before=lambda self, batch, *a, **k: log(
        "run_batch", tree_cache=type(self.tree_cache).__name__, batch=type(batch).__name__,
        forward_mode=str(getattr(batch, "forward_mode", None)),
        reqs=[_req(r) for r in getattr(batch, "reqs", [])][:3]) if not _COUNTS.get("run_batch") or True else None))
    later("sglang.srt.managers.schedule_batch", lambda m: wrap(
        m.ScheduleBatch, "retract_decode", after=lambda out, self, *a, **k: log(
            "retract_decode", retracted=[_req(r) for r in out[0]][:4])))
    later("sglang.srt.managers.scheduler", lambda m: (
        wrap(m.Scheduler, "abort_request", before=lambda self, recv, *a, **k: log(
            "abort_request", rid=getattr(recv, "rid", None), abort_all=getattr(recv, "abort_all", None))),
        wrap(m.Scheduler, "init_tp_model_worker", after=lambda out, self, *a, **k: log(
            "scheduler_worker", tp_worker=type(self.tp_worker).__name__,
            tree_cache=type(getattr(self, "tree_cache", None)).__name__))))
