"""A bounded pack: packing ahead of the trainings reading it (ahead, bound, trainings), trimming
behind them (trim_policy, trim) and packing trimmed shards again (restore, restorable)."""
