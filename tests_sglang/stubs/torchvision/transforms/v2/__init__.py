"""Imported as a module (``torchvision.transforms.v2.functional as tvF``) by SGLang's multimodal processors."""
