"""bagel-prepack: offline packing of BAGEL-style multimodal batches (sources -> packer -> writer)."""

__version__ = "0.1.0"
