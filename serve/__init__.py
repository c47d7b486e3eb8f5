"""The Ray Serve + FastAPI app that answers lineage and attestation queries over HTTP, reading the
tracking store read-only. It arrives with the attestation issue."""
