"""Protect HuggingFace transformers continuous batching (``generate_batch``, the CB manager).

One call::

    with kvcanary.engines.transformers.protect(model) as guard:
        out = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    print(guard.stats(), guard.violations)

=============== ===================================================================================
module          what it holds
=============== ===================================================================================
``entry``       :func:`protect` and :class:`Protection`, the forwards bracketed and reported
``scheduler``   what it follows of the scheduler and cache manager: groups, first reads, frees
``steps``       each forward's steps, one per layer group, from the batch's own metadata
``compiled``    the same built by compiled loops into buffers kept across forwards (CPU pools)
``heal``        ``quarantine`` and ``repair``: the requests that read corrupted KV failed or recomputed
``audit``       the write check and read audit inside each forward
``groups``      one canary per layer group, over the group's geometry
``transfer``    stamps that travel with offloaded and copied blocks
``hooks``       the class-level patches that bracket each forward
``models``      small random-weight models and CPU-friendly configurations (nothing downloaded)
=============== ===================================================================================

transformers is imported inside functions only; ``import kvcanary`` never needs it.
"""

from __future__ import annotations

from kvcanary.engines.transformers.entry import Protection, check_version, protect
from kvcanary.engines.transformers.groups import group_layout
from kvcanary.engines.transformers.models import cb_configs, tiny_model

__all__ = ["Protection", "protect", "check_version", "group_layout", "tiny_model", "cb_configs"]
