"""Data layer: corpus fingerprints, Ray Data ingest, route-partitioned shards."""
