"""Hyperparameter search on Ray Tune: the driver, its trials, hosts, record, rows and progress."""
