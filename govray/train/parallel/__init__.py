"""How a run's workers hold the model: the parallelism twins (single, DDP, FSDP, HSDP) and the worker."""
