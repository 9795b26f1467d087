"""The fused CPU path: each op of :mod:`kvcanary.ops` as one compiled loop (numba), bit for bit the
torch reference. Importing this package imports nothing heavy; :func:`available` says whether the
compiled loops can be used here."""

from __future__ import annotations

_why: list[str | None] = []


def available() -> str | None:
    """``None`` when the fused path works on this machine, else why not (checked once)."""
    if not _why:
        try:
            import numba  # noqa: F401

            from kvcanary.fused import ops  # noqa: F401
            _why.append(None)
        except Exception as e:  # an absent or broken numba: the torch path takes over
            _why.append(f"{type(e).__name__}: {e}")
    return _why[0]
