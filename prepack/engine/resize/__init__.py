"""Pillow-exact bicubic resize of RGB pictures: a vectorized kernel where it is proven equal to the
installed Pillow in this process, Pillow itself otherwise.

The packer's pictures are resized once each (ViT and VAE targets, edit frames, video frames) and
that resize was most of a packing worker's CPU.  Parity with the reference needs Pillow's exact
bytes, so the kernel mirrors one pinned Pillow release and proves itself at first use.
"""

from prepack.engine.resize.router import (
    ENV_SWITCH,
    PINNED_PILLOW,
    Resizer,
    default_resizer,
    pillow_resize,
    resize_coded,
    resize_pixels,
)

__all__ = ["ENV_SWITCH", "PINNED_PILLOW", "Resizer", "default_resizer", "pillow_resize", "resize_coded",
           "resize_pixels"]
