"""An empty stand-in for torchvision, for kvcanary's SGLang tests only.

PyPI's torchvision wheels do not load beside the CPU build of torch 2.13 here (its compiled
operators fail to register), and without any torchvision SGLang 0.5.23 does not import: its
multimodal helpers import ``torchvision.transforms`` at module load, and once a torchvision is
present transformers also imports a few names from it. This package holds exactly the names the
engine imports while it starts and serves a text-only model; the enums are real, every function
raises StandInError if called. ``__version__`` is read by transformers (as the release that pairs
with torch 2.13)."""

__version__ = "0.28.0+kvcanary.stub"
