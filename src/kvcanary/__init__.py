"""kvcanary: catch silent KV-cache corruption in LLM serving engines.

Every KV slot carries a stamp (token, position, prefix link, content fingerprint) written when the
engine writes the slot; every slot a forward is about to read is verified against the step's own
slot table; violations are recorded on the pool's device and drained as typed records.
"""

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
from kvcanary.layout import ByteSource, KvLayout
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
