"""Without a GPU, Triton kernels run under the interpreter (set before any kernel module loads)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
