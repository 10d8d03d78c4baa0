"""Running a pack: the Ray driver, one stream's job, the shard writer, stream leases and identity."""
