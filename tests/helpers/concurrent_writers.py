"""Writer processes for "concurrent writers lose no rows": each opens its own engine on the store
and, at the same moment as the others, logs metrics for its own trial, appends to the one shared
audit chain, and records checkpoints with their ledger rows — what a Ray Train controller does.

Processes are spawned, not forked: a child must not inherit the parent's connections (or, in a
test session that runs Ray, its threads).
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.synchronize import Barrier

from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import record_checkpoint, record_ledger
from govray.tracking.store import TrackingStore
from govray.tracking.tables import MetricKind

LEDGER_TENSORS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
BIG_COUNT = 3 * 2**31  # tokens past 32 bits, as a long text run reaches


def metric_values(writer: int, step: int) -> dict[str, float]:
    return {"loss": 1 / (writer + step + 1), "lr": 1e-3 * (writer + 1)}


def ledger_of(writer: int, step: int) -> list[tuple[str, str, int | None, int, int, int]]:
    """The rows writer ``writer`` records for its checkpoint at ``step``."""
    return [
        (f"corpus-{writer}", tensor, layer, step + 1, BIG_COUNT + step, step + 1)
        for layer, tensor in enumerate(LEDGER_TENSORS)
    ]


def write(url: str, experiment_id: int, trial_id: int, writer: int, steps: int, start: Barrier) -> None:
    store = TrackingStore(url)
    try:
        log = AuditLog(store)
        start.wait(timeout=120)
        for step in range(steps):
            store.log_metrics(trial_id, step, MetricKind.TRAINING, metric_values(writer, step))
            log.append(
                AuditEventType.GC_DELETED, {"writer": writer, "step": step}, experiment_id=experiment_id
            )
            checkpoint = record_checkpoint(store, trial_id, f"/checkpoints/{writer}/{step}", step)
            record_ledger(store, trial_id, ledger_of(writer, step), checkpoint_id=checkpoint.id)
    finally:
        store.close()


def run_writers(url: str, experiment_id: int, trial_ids: list[int], steps: int) -> list[int | None]:
    """Run one writer process per trial, all starting together; return their exit codes."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(len(trial_ids))
    processes = [
        context.Process(target=write, args=(url, experiment_id, trial_id, writer, steps, start))
        for writer, trial_id in enumerate(trial_ids)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    for process in processes:
        if process.is_alive():
            process.kill()
    return [process.exitcode for process in processes]


def open_store(url: str, start: Barrier) -> None:
    start.wait(timeout=120)
    TrackingStore.open(url).close()  # migrates an empty database


def run_openers(url: str, count: int) -> list[int | None]:
    """``count`` processes opening the same empty store at the same moment; their exit codes."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(count)
    processes = [context.Process(target=open_store, args=(url, start)) for _ in range(count)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    return [process.exitcode for process in processes]
