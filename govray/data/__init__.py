"""Data layer: corpus fingerprints and validation, Ray Data ingest, route-partitioned shards and the
deterministic step schedule over them (which rows each rank takes at each step)."""
