"""The on-disk contract shared by the packer (``prepack``) and the reader (``loader``).

Record schema, pack layout and documents (stream index, done.json, pack.json, manifest),
stream checkpoint, compression, location, config model and the errors live here and nowhere
else.  The modules the loader imports need only numpy, pyarrow, xxhash and the standard library
(config needs yaml; the record encoder's zstd is imported by the writer side only).
"""
