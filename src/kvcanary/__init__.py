"""kvcanary: catch silent KV-cache corruption in LLM serving engines.

Every KV slot carries a stamp (token, position, prefix link, content fingerprint) written when the
engine writes the slot; every slot a forward is about to read is verified against the step's own
slot table; violations are recorded on the pool's device and drained as typed records.

The public names are imported from their modules on first access (PEP 562), so that
``import kvcanary`` and the command line's ``--help`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.canary import Canary
    from kvcanary.config import CanaryConfig
    from kvcanary.errors import (
        ConfigError,
        KvCanaryError,
        KvCorruptionError,
        LayoutError,
        StepError,
        UnsupportedError,
    )
    from kvcanary.layout import KvLayout
    from kvcanary.source import ByteSource
    from kvcanary.step import Step
    from kvcanary.violations import Check, Site, Violation

__version__ = "0.1.0"

__all__ = [
    "ByteSource",
    "Canary",
    "CanaryConfig",
    "Check",
    "ConfigError",
    "KvCanaryError",
    "KvCorruptionError",
    "KvLayout",
    "LayoutError",
    "Site",
    "Step",
    "StepError",
    "UnsupportedError",
    "Violation",
]

# public name -> the module that defines it (the imports under TYPE_CHECKING above, for type checkers)
_HOME = {
    "ByteSource": "kvcanary.source",
    "Canary": "kvcanary.canary",
    "CanaryConfig": "kvcanary.config",
    "Check": "kvcanary.violations",
    "ConfigError": "kvcanary.errors",
    "KvCanaryError": "kvcanary.errors",
    "KvCorruptionError": "kvcanary.errors",
    "KvLayout": "kvcanary.layout",
    "LayoutError": "kvcanary.errors",
    "Site": "kvcanary.violations",
    "Step": "kvcanary.step",
    "StepError": "kvcanary.errors",
    "UnsupportedError": "kvcanary.errors",
    "Violation": "kvcanary.violations",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first access, then keep it in the package."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvcanary' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
