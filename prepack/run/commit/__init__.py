"""The commit: a stream's shards, pixel indexes, lineage, checkpoints and index written whole or not
at all (writer, atomic_files, direct_file, checkpoint_files, lineage), and back to the committed
prefix after a crash (recovery)."""
