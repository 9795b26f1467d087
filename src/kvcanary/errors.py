"""Every exception kvcanary raises.

::

    KvCanaryError                      base of everything below
    ├── ConfigError (ValueError)       a CanaryConfig field out of range
    ├── LayoutError (ValueError)       a KV layout that cannot be read as described
    ├── StepError (ValueError)         step metadata with a bad shape, dtype or value
    ├── UnsupportedError (RuntimeError) a device, dtype or engine version kvcanary cannot handle
    └── KvCorruptionError (RuntimeError) violations found in ``raise`` mode; carries the records
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from kvcanary.violations import Violation


class KvCanaryError(Exception):
    """Base class of all kvcanary errors."""


class ConfigError(KvCanaryError, ValueError):
    """A configuration value is out of range."""


class LayoutError(KvCanaryError, ValueError):
    """A KV layout cannot be read as described."""


class StepError(KvCanaryError, ValueError):
    """Step metadata has a bad shape, dtype or value."""


class UnsupportedError(KvCanaryError, RuntimeError):
    """A device, dtype or engine version kvcanary cannot handle."""


class KvCorruptionError(KvCanaryError, RuntimeError):
    """Raised by ``poll()`` in ``raise`` mode when violations were recorded.

    Attributes
    ----------
    violations : the decoded records (at most the ring's capacity)
    lost : how many further violations overflowed the ring before they could be drained
    """

    def __init__(self, violations: Sequence[Violation], lost: int = 0) -> None:
        self.violations = list(violations)
        self.lost = lost
        head = "; ".join(v.describe() for v in self.violations[:3])
        more = len(self.violations) - 3
        tail = f" (+{more} more)" if more > 0 else ""
        lost_s = f", {lost} lost to ring overflow" if lost else ""
        super().__init__(f"{len(self.violations)} KV-cache violation(s){lost_s}: {head}{tail}")

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None
