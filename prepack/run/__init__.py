"""Running a pack: the Ray driver, one stream's job, the shard writer, the output lock and identity."""
