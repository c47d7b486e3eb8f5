"""What runs on a worker: the trial contract, the governed step, the controller that takes or
replays decisions, the session twins (Ray Train, local, Tune), the ledger, signed checkpoints and
the reproducibility record. Nothing here reads or writes the tracking database."""
