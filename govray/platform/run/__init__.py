"""One governed run from the driver: preflight, the run plan, Ray Train, its recorder and reconciliation."""
