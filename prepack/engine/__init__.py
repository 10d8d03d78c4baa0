"""The packing engine: sources -> samples -> greedy-packed ``PackedBatch`` objects, with checkpointable state.

Pure computation over one stream; no Ray, no output files (``prepack.run`` writes them).
"""
