"""The memory footprint: one rank's peak memory for a run as configured, estimated before it is queued."""
