"""Audit the write and the read: what per-slot stamps cannot see.

A stamp says which token and position a slot holds and fingerprints the bytes found there after
the write. Two things escape it: a cache write that lands other bytes than the model computed
(zeros, the wrong head, nothing at all: the stamp fingerprints whatever landed), and an attention
kernel that reads or weighs the right bytes wrongly (its own page arithmetic, a head order or K/V
layout that disagrees with the writer's, a dequantization scale, a mask, a softmax scale). Engine
adapters run two checks inside each protected forward:

- **write check**: for each new token of a layer, the K and V rows the model computed (the
  inputs of the engine's cache-write op) are compared bit for bit with the rows the cache holds
  at the token's slot after the write (:func:`~kvcanary.audit.reference.write_mismatch`). Every new token of every layer
  with ``content_budget_bytes=None``; within the budget otherwise, rotating over the tokens.
  A mismatch is a ``WRITE_CONTENT`` violation at site ``write``.
- **read audit**: for a few sampled queries per forward (``audit_queries``: a layer, a request's
  new token and an attention head, rotating so every layer, request and head comes round), the
  attention output is recomputed in fp32 from the cache bytes at the slots the verified table
  names, with the model's own scale, causal and sliding-window mask, attention sinks and logit
  soft-capping (:func:`~kvcanary.audit.reference.attend`), and compared with the engine's output for that query. An error
  above :func:`~kvcanary.audit.reference.tolerance` (as a fraction of the largest |V| the query reads) is an ``ATTENTION``
  violation at site ``audit``; where reading every block one page on or back explains the
  engine's output, the record says so.

The package: :mod:`~kvcanary.audit.reference` (the torch reference: the checks' formulas, any
device), :mod:`~kvcanary.audit.records` (a forward's queries, writes and per-layer plans),
:mod:`~kvcanary.audit.tables` (the compiled loop's tables, their columns named),
:mod:`~kvcanary.audit.auditor` (the rotation, the counts, the decoding into violations). The
compiled loop is :mod:`kvcanary.fused.audit`; the glue both engine adapters share is
:mod:`kvcanary.engines.audit`. Nothing reads a device value on the host until the adapter drains
the results after the forward (:meth:`~kvcanary.audit.auditor.Auditor.drain`).
"""
