"""Tools over a pack: verify, audit (re-pack and compare), inspect one record, stats over lineage."""
