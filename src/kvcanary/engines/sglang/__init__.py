"""Protect SGLang's engine with one environment variable: ``KVCANARY_MODE=log`` (or ``raise``,
``quarantine``, ``repair``) where SGLang starts; kvcanary's ``sglang.srt.plugins`` entry point does the rest.

=============== ===================================================================================
module          what it holds
=============== ===================================================================================
``entry``       :class:`~.entry.SglangCanary`, the adapter, and its installation
``hooks``       the SGLang methods the adapter wraps, and what it does in each
``scheduler``   each request's token stream, from the scheduler's own request state
``steps``       a forward's step from its ``ForwardBatch`` and ``req_to_token``
``audit``       the write check and read audit on the torch-native attention backend
``heal``        ``repair``, ``quarantine`` and ``raise`` through SGLang's own retraction and abort paths
``plugin``      the ``sglang.srt.plugins`` entry point
=============== ===================================================================================

Nothing here is imported by ``import kvcanary``; :mod:`.steps` and :mod:`.scheduler` import nothing
of SGLang's.
"""
