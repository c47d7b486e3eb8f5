"""The driver: preflight, runs (Ray Train), searches (Tune), replays, lifecycle, the run recorder,
checkpoint garbage collection and reconciliation, the model registry and job submission."""
