"""What a finished model proves: signed attestations and their verification, row lookup, the
EU training-content summary and recomputation of a ledger from its inputs."""
