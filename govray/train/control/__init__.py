"""Metric-driven control of a trial: the controller, its recorded decisions, validation, probes and
preemption."""
