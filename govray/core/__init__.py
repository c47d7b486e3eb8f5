"""Foundations every layer uses: errors, canonical JSON and digests, YAML documents, the Ray
runtime handle, identifiers, storage (local or s3://), per-rank logs, signing keys and DSSE envelopes."""
