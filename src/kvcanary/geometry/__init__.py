"""Cache geometries: where one layer's K and V of every slot live in an engine's cache, described once.

======================================== ==========================================================
geometry                                 the engine's cache
======================================== ==========================================================
:func:`~.vllm_cpu.vllm_cpu`              vLLM's CPU backend: ``vec``/``vec16`` (strided) and ``amx``
:func:`~.vllm_gpu.vllm_gpu`              vLLM's GPU backends (FlashAttention, FlashInfer, Triton, Flex)
:class:`~.token_pages.TokenPages`        transformers continuous batching: a layer group's pages
:func:`~.pages.page_major`               ``[blocks, block_size, heads, dim]`` pages (FlashAttention...)
======================================== ==========================================================

Each gives a :class:`~.base.KvGeometry` per layer: its byte sources, typed rows, compiled-loop
descriptors and element offsets (:mod:`kvcanary.geometry.base`). Nothing else in kvcanary computes
offsets into a cache.
"""
