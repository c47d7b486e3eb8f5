"""``govray verify --recompute-ledger``: recompute an attested ledger from its recorded schedule.

The coverage statement says which examples reached which tensor; it also carries every input of
the schedule. This module recomputes the ledger from those inputs, the routing table (the trial's
model resolved by the attested policy) and, for a run that started from another checkpoint, that
checkpoint's verified ledger — and compares it entry by entry with what was attested::

    verified = verify_attestation(coverage_envelope, model_dir=checkpoint, trust=trust)
    check_attested_ledger(verified.statement, checkpoint, trust)   # AttestationError on a mismatch

Steps a memorization rollback discarded reached nothing (``ScheduleSpec.reverted``); a model
version made by removing adapters leaves those adapters' tensors out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from govray.core.errors import AttestationError
from govray.core.keys import TrustConfig
from govray.data.packed import PackedStore
from govray.data.schedule import ScheduleError, ScheduleSpec
from govray.data.shard_reader import ShardReader
from govray.data.shards import ShardSet
from govray.provenance.locations import run_spec_of
from govray.provenance.statement_types import COVERAGE_TYPE
from govray.train.checkpoints.files import CheckpointError, load_checkpoint
from govray.train.checkpoints.ledger_check import expected_ledger, ledger_differences
from govray.train.parallel.worker import RouteRows
from govray.train.step.ledger import Ledger, LedgerEntry
from govray.train.trial import make_trial

SHOWN = 5  # differences named in the error


def check_attested_ledger(statement: dict[str, Any], model_dir: Path, trust: TrustConfig) -> int:
    """Recompute the ledger a verified coverage ``statement`` attests for ``model_dir`` (a checkpoint
    or a sealed model version); returns the number of entries that matched, or raises
    ``AttestationError`` naming the first differences."""
    if statement.get("predicateType") != COVERAGE_TYPE:
        raise AttestationError("recomputing the ledger needs the coverage statement")
    predicate = statement["predicate"]
    try:
        schedule = ScheduleSpec.from_json(predicate["schedule"])
    except (KeyError, TypeError, ValueError, ScheduleError) as error:
        raise AttestationError(f"the attested schedule is unreadable: {error}") from None
    if schedule.digest() != predicate.get("schedule_sha256"):
        raise AttestationError("the attested schedule does not hash to the attested schedule_sha256")
    try:
        loaded = load_checkpoint(model_dir, trust)
    except CheckpointError as error:
        raise AttestationError(f"cannot recompute the ledger: {error}") from None
    spec = run_spec_of(model_dir)
    routing = spec.routing
    trial = make_trial(spec.trial, spec.hparams, spec.settings)
    packed = PackedStore.open(Path(spec.packed_root), verify=True) if spec.packed_root else None
    counts = RouteRows(ShardReader(ShardSet.open(Path(spec.shard_root))), packed).counts(trial)
    source = _source_ledger(loaded.state.source, trust) if loaded.state.source else None
    recomputed = expected_ledger(schedule, routing, int(predicate["steps"]), counts, source)
    removed = sorted(set(routing.adapter_names.values()) - set(loaded.state.adapters))
    for adapter in removed:
        recomputed = recomputed.without_adapter(adapter)
    attested = _attested(predicate.get("ledger", []))
    problems = ledger_differences(attested, recomputed, said="attested")
    if problems:
        shown = "; ".join(problems[:SHOWN])
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise AttestationError(
            f"the attested ledger differs from the one recomputed from the schedule: {shown}{more}"
        )
    return len(attested)


def _source_ledger(source: dict[str, Any], trust: TrustConfig) -> Ledger:
    path = Path(str(source.get("path", "")))
    try:
        loaded = load_checkpoint(path, trust)
    except CheckpointError as error:
        raise AttestationError(
            f"the run started from checkpoint {path}, whose ledger is needed: {error}"
        ) from None
    if loaded.manifest_digest != source.get("manifest_sha256"):
        raise AttestationError(f"{path}: not the checkpoint the run started from (manifest digest differs)")
    return Ledger.from_json(loaded.state.ledger)


def _attested(entries: list[dict[str, Any]]) -> dict[tuple[str, str], LedgerEntry]:
    try:
        return {
            (str(e["corpus"]), str(e["tensor"])): LedgerEntry(
                int(e["examples"]), int(e["tokens"]), int(e["steps"])
            )
            for e in entries
        }
    except (KeyError, TypeError, ValueError) as error:
        raise AttestationError(f"an attested ledger entry is malformed: {error}") from None
