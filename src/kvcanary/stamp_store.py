"""Stamps that travel with KV a connector stores outside the engine (a file-backed prefix store, a
prefill/decode split in miniature): saved beside it, keyed by the prefix's own token ids, so the
engine that loads the KV installs the stamps and verifies the landed bytes against them.

The stamps of a prefix are saved under the keys of the prefix lengths the KV store may hand back
(vLLM's file-backed ExampleConnector stores a prompt's whole blocks but one token and loads the
whole blocks of the prompt but two, so both); :func:`load` takes the key of the landed prefix.
"""

from __future__ import annotations

import hashlib
import os

import torch


def key(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:32]


def save(root: str, tokens: list[int], stamps: torch.Tensor, lengths: set[int]) -> None:
    """Save ``stamps`` (int64 ``[n, 4]``, positions ``0 .. n-1`` of ``tokens``) under the prefixes
    of ``lengths`` (at most ``n``); files are replaced atomically."""
    os.makedirs(root, exist_ok=True)
    for m in sorted(x for x in lengths if 0 < x <= min(len(tokens), stamps.shape[0])):
        path = os.path.join(root, key(tokens[:m]) + ".stamps")
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(stamps[:m].cpu().clone(), tmp)
        os.replace(tmp, path)


def load(root: str, tokens: list[int]) -> torch.Tensor | None:
    """The stamps saved for exactly the prefix ``tokens``, or ``None`` where none travelled."""
    path = os.path.join(root, key(tokens) + ".stamps")
    if not os.path.exists(path):
        return None
    out: torch.Tensor = torch.load(path)
    return out if out.shape[0] == len(tokens) else None
