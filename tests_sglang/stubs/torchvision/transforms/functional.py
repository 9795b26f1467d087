import enum

from _kvcanary_stubs import unsupported


class InterpolationMode(enum.Enum):  # imported as default argument values at module load
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


pil_to_tensor = unsupported(__name__, "pil_to_tensor")  # imported by transformers.image_utils
