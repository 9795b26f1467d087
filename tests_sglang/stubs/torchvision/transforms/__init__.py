from torchvision.transforms.functional import InterpolationMode  # noqa: F401
