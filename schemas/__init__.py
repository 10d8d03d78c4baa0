"""The on-disk contract shared by the packer (``prepack``) and the reader (``loader``).

Record schema, manifest, stream checkpoint and config model live here and nowhere else.
This package imports only numpy, pyarrow and the standard library (plus yaml for configs).
"""
