"""A ledger per checkpoint in the tracking store: stored as each checkpoint is recorded, from its
verified ``state.json``. A checkpoint whose ledger could not be stored then (its ``state.json`` did
not verify: the recorder logs why) gets it from a write (the lineage app's
``POST /api/checkpoints/N/ledger``; no read writes), or that write says why not.

Lineage, influence and row lookups then answer for every recorded checkpoint, and for a running
trial as of its latest one. Nothing is stored that was not verified: a checkpoint's ``state.json``
must match the manifest the store recorded for it (and, given a trust configuration, the manifest
must carry a trusted platform signature)::

    record = record_checkpoint_ledger(store, trial_id, path, step, layers, trust)  # the recorder
    store_checkpoint_ledger(store, checkpoint_id, trust)   # one not stored then, on a write
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from govray.core.keys import TrustConfig
from govray.tracking.lineage import (
    LedgerTuple,
    checkpoint_ledger_rows,
    checkpoint_record,
    record_checkpoint,
    record_ledger,
)
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointRecord, CheckpointStatus
from govray.train.checkpoints.files import CheckpointError, recorded_state
from govray.train.checkpoints.manifest import listed_bytes, recorded_manifest
from govray.train.runspec import RUN_SPEC_FILE, parse_run_spec
from govray.train.step.ledger import Ledger, LedgerError

Layers = Mapping[str, int | None]  # tensor name → its layer index (None: outside the layers)


def ledger_tuples(ledger: Ledger, layers: Layers) -> list[LedgerTuple]:
    """A ledger as the store's rows: ``(corpus, tensor, layer, examples, tokens, steps)``."""
    return [
        (corpus, tensor, layers.get(tensor), entry.examples, entry.tokens, entry.steps)
        for corpus, tensor, entry in ledger.rows()
    ]


def record_checkpoint_ledger(
    store: TrackingStore,
    trial_id: int,
    path: str,
    step: int,
    layers: Layers | None,
    trust: TrustConfig | None,
) -> CheckpointRecord:
    """Record a checkpoint the run just saved, then its ledger from its ``state.json`` (verified).
    ``layers`` None: read from the run spec the checkpoint holds."""
    record = record_checkpoint(store, trial_id, path, step)
    _store(store, record, layers, trust)
    return record


def store_checkpoint_ledger(store: TrackingStore, checkpoint_id: int, trust: TrustConfig | None) -> int:
    """Store the ledger of a recorded checkpoint whose rows are not stored yet, from its verified
    ``state.json``; returns how many rows were written (0: they were there). ``CheckpointError``
    when its files are gone (GC deleted it) or no longer match what the store recorded."""
    record = checkpoint_record(store, checkpoint_id)
    if checkpoint_ledger_rows(store, checkpoint_id):
        return 0
    if record.state != CheckpointStatus.ACTIVE.value:
        raise CheckpointError(
            f"checkpoint {checkpoint_id} (step {record.step} of trial {record.trial_id}) was deleted by GC "
            "before its ledger was stored; no verified state.json is left to read it from"
        )
    return _store(store, record, None, trust)


def _store(
    store: TrackingStore, record: CheckpointRecord, layers: Layers | None, trust: TrustConfig | None
) -> int:
    assert record.id is not None
    directory = Path(record.path)
    state = recorded_state(directory, record.manifest_digest, trust)
    try:
        ledger = Ledger.from_json(state.ledger)
    except LedgerError as error:
        raise CheckpointError(f"{directory}: its state.json holds {error}") from None
    if layers is None:
        layers = _layers(directory, record.manifest_digest, trust)
    rows = ledger_tuples(ledger, layers)
    return record_ledger(store, record.trial_id, rows, checkpoint_id=record.id)


def _layers(directory: Path, manifest_digest: str, trust: TrustConfig | None) -> Layers:
    """Tensor → layer from the run's own spec, as the checkpoint's recorded manifest lists it (a
    changed one is refused); a checkpoint sealed without a spec: every layer index None."""
    manifest = recorded_manifest(directory, manifest_digest, trust)  # read and checked once
    if RUN_SPEC_FILE not in manifest.files:
        return {}
    spec = parse_run_spec(listed_bytes(directory, manifest, RUN_SPEC_FILE), directory / RUN_SPEC_FILE)
    return spec.routing.tensor_layers()
