"""The audit's torch reference: the write check's bitwise comparison, fp32 attention over the cached
keys, the error measure and its tolerance, and one layer's audited queries checked with torch ops
on the pool's device (any device: nothing reads a value on the host)."""

from __future__ import annotations

from typing import Callable

import torch

from kvcanary.audit.records import ForwardAudit, LayerPlan

# The largest accepted audit error (max |engine - reference| / max |V| read) by the dtype the engine
# computes attention in, as ``base + slope * m`` where ``m = sum_i p_i |s_i|`` is the query's
# probability-weighted mean |logit| (after the scale and soft-cap). A bf16 or fp16 kernel that rounds
# its logits to that dtype (transformers' eager kernels) errs in proportion to their size, one that
# keeps them in fp32 (sdpa on a CPU, vLLM's CPU kernels) does not; so the tolerance grows with the
# logits: 5 units in the last place (u = 2**-8 for bf16, 2**-11 for fp16) times (1 + m). fp32 is
# fixed. Calibration (bench/audit_calibration.py, results in bench/results/audit_calibration_*):
# over 1.76M clean queries of randomized continuous-batching runs (7 architectures, forks, windows,
# sinks, tight memory, offload; flat attention and softmax scales sharpened 100x and 300x to
# trained-model logit sizes) the largest clean error is 2.7e-5 in fp32 (37x under 1e-3) and
# 1.12 (bf16) / 1.15 (fp16) in units of u * (1 + m) (4.4x under 5); every injected kernel fault
# class of kvcanary.faults is caught in every dtype and regime with these. On a trained model's own
# logits (SmolLM2-135M-Instruct, --real: 654K clean queries, m up to 29, sdpa and eager) the clean
# maximum is 0.094 of the tolerance in bf16 and 1.2e-3 in fp32, and every fault class's weakest run
# lands 4.9x above it or more: the random and sharpened regimes bound the tolerance, not the model.
TOLERANCE = {torch.float32: (1e-3, 0.0), torch.float16: (5 * 2.0**-11, 5 * 2.0**-11),
             torch.bfloat16: (5 * 2.0**-8, 5 * 2.0**-8)}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the compiled loops' float codes
BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tolerance(dtype: torch.dtype, mean_logit: float = 0.0) -> float:
    """The audit's default tolerance for attention computed in ``dtype`` for a query whose
    probability-weighted mean |logit| is ``mean_logit`` (see :data:`TOLERANCE`)."""
    base, slope = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    return base + slope * mean_logit


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: equal bits compare equal (NaNs included), -0.0 differs from 0.0."""
    return t.contiguous().view(BIT_VIEW[t.element_size()])


def write_mismatch(src_k: torch.Tensor, src_v: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compare computed K/V rows ``[n, Hkv, D]`` with the cache's rows at their slots ``[n, Hkv, D]``.

    Returns ``(half, head)``, int64 ``[n]``: which half differs (0 none, 1 K, 2 V, 3 both) and the
    first KV head that differs. The computed rows are cast to the cache's dtype first, as the
    engine's write does; the comparison is bitwise.
    """
    kb = (_bits(cache_k) != _bits(src_k.to(cache_k.dtype))).flatten(2).any(-1)  # [n, Hkv]
    vb = (_bits(cache_v) != _bits(src_v.to(cache_v.dtype))).flatten(2).any(-1)
    half = kb.any(-1).long() + 2 * vb.any(-1).long()
    head = (kb | vb).long().argmax(-1)
    return half, head


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
           softcap: float | None = None, sink: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 attention of ``S`` single queries over their own keys.

    ``q`` ``[S, D]``; ``k``, ``v`` ``[S, L, D]``; ``valid`` bool ``[S, L]`` (the positions each query
    reads); ``softcap``: logits become ``cap * tanh(logit / cap)``; ``sink`` ``[S]``: a learned logit
    per query's head that joins the softmax and adds no value. Returns the outputs ``[S, D]``, the
    largest |V| each query reads ``[S]`` and its probability-weighted mean |logit| ``[S]``.
    """
    qf, kf, vf = q.float(), k.float(), v.float()
    logits = torch.einsum("sd,sld->sl", qf, kf) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~valid, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.float()[:, None]], dim=1)
    p = torch.softmax(logits, dim=1)[:, : kf.shape[1]]
    out = torch.einsum("sl,sld->sd", p, vf)
    vmax = vf.abs().amax(-1).masked_fill(~valid, 0).amax(-1)
    mean = (p * logits[:, : kf.shape[1]].abs().masked_fill(~valid, 0)).sum(-1)
    return out, vmax, mean


def error(engine_out: torch.Tensor, ref: torch.Tensor, vmax: torch.Tensor) -> torch.Tensor:
    """Each query's largest deviation from the reference as a fraction of the largest |V| it read
    (a NaN or infinite engine output counts as an error of 1e6)."""
    e = (engine_out.float() - ref).abs().amax(-1) / vmax.clamp(min=1e-30)
    return torch.nan_to_num(e, nan=1e6, posinf=1e6)


def check_layer(fa: ForwardAudit, plan: LayerPlan, slots: torch.Tensor, q: torch.Tensor, engine_out: torch.Tensor,
                read: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                softcap: float | None, sink: torch.Tensor | None, tol: tuple[float, float]) -> None:
    """Audit one layer's queries of ``fa``: ``slots`` ``[S, W]`` the verified table's slots of
    ``plan.grid`` (-1: none); ``q`` and ``engine_out`` ``[S, D]`` the queries and the engine's outputs;
    ``read(slots, shift)`` the cache's K and V ``[S, W, D]`` at those slots, with the positions cached
    before this forward read ``shift`` blocks on; ``tol``: the tolerance's base and slope
    (:data:`TOLERANCE`). Fills the queries' errors and tolerances in ``fa`` (device ops only). A query
    that reads a position the cache does not hold (a prefill's own tokens past a window) is not
    audited."""
    complete = (slots >= 0).logical_or(~plan.inside).all(1)
    valid = plan.inside & (slots >= 0)
    errs, limits = [], []
    for shift in (0, 1, -1):  # as read, then every cached block one page on / back
        k, v = read(slots, shift)
        ref, vmax, mean = attend(q, k, v, valid, scale, softcap, sink)
        errs.append(error(engine_out, ref, vmax))
        limits.append(tol[0] + tol[1] * mean)
    e, limit = errs[0], limits[0]  # the tolerance of the query as read
    explained = torch.where(errs[1] <= limit, 1, torch.where(errs[2] <= limit, -1, 0))
    fa.err[plan.picked] = torch.where(complete, e, -1.0).to(fa.err.dtype)
    fa.shift[plan.picked] = torch.where(e > limit, explained, 0).to(fa.shift.dtype)
    fa.tol[plan.picked] = limit.to(fa.tol.dtype)
