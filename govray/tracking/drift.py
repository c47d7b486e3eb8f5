"""Data drift between runs: which corpora's bytes changed since an experiment last ran.

A re-run of an experiment whose data changed is no longer a re-run; the caller warns, naming
each corpus, or refuses under ``--strict``::

    for change in changed_corpora(store, config.name, fingerprints):
        warn(f"corpus '{change.corpus_id}' changed since the last run")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from govray.tracking.store import TrackingStore


@dataclass(frozen=True)
class FingerprintChange:
    """A corpus whose fingerprint differs from the one the previous run recorded."""

    corpus_id: str
    before: str
    after: str


def changed_corpora(
    store: TrackingStore,
    experiment_name: str,
    fingerprints: Mapping[str, str],
    *,
    excluding: int | None = None,
) -> list[FingerprintChange]:
    """Corpora (by id) whose fingerprint differs from the previous run of ``experiment_name``.

    The previous run is the newest experiment of that name, other than ``excluding`` (the current
    run's id, if it already recorded its corpora), that has corpora recorded. Corpora it did not
    have are new, not changed; no previous run means no changes.
    """
    for experiment in reversed(store.list_experiments()):
        if experiment.name != experiment_name or experiment.id == excluding:
            continue
        assert experiment.id is not None  # read from the database
        recorded = {row.corpus_id: row.fingerprint for row in store.list_corpora(experiment.id)}
        if recorded:
            return [
                FingerprintChange(corpus_id, recorded[corpus_id], fingerprint)
                for corpus_id, fingerprint in sorted(fingerprints.items())
                if corpus_id in recorded and recorded[corpus_id] != fingerprint
            ]
    return []
