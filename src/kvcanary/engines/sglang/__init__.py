"""Protect SGLang's engine with one environment variable: ``KVCANARY_MODE=log`` (or ``raise``,
``quarantine``) where SGLang starts; kvcanary's ``sglang.srt.plugins`` entry point does the rest.

=============== ===================================================================================
module          what it holds
=============== ===================================================================================
``entry``       :class:`~.entry.SglangCanary`, the adapter, and the SGLang methods it wraps
``scheduler``   each request's token stream, from the scheduler's own request state
``steps``       a forward's step from its ``ForwardBatch`` and ``req_to_token``
``heal``        ``quarantine`` and ``raise`` through SGLang's own abort path
``plugin``      the ``sglang.srt.plugins`` entry point
=============== ===================================================================================

Nothing here is imported by ``import kvcanary``; :mod:`.steps` and :mod:`.scheduler` import nothing
of SGLang's.
"""
