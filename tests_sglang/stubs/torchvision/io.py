import enum

from _kvcanary_stubs import unsupported


class ImageReadMode(enum.Enum):  # imported by transformers.image_utils when torchvision is present
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


decode_image = unsupported(__name__, "decode_image")
