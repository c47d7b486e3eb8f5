"""Governance counters for the Ray dashboard's metrics view, exported with ``ray.util.metrics``.

Rank 0 knows every worker's slot at every step (the schedule is a pure function of its inputs),
so it alone exports them, without communication:

==================================== ======= ===================================================
name (Prometheus)                    kind    value
==================================== ======= ===================================================
``ray_govray_examples_total``        counter training examples, per ``corpus`` and ``route``
``ray_govray_masked_fraction``       gauge   fraction of trainable parameter elements that no
                                             slot of the last step could update (no update)
``ray_govray_memorization_score``    gauge   ``memorization_score`` of the last validation
``ray_govray_corpus_memorization``   gauge   each monitored ``corpus``'s normalized score
==================================== ======= ===================================================

Every series is tagged with ``experiment`` (its name) and ``trial`` (the trial's run name). Ray's
metrics agent on each node serves them on the node's Prometheus endpoint (``ray start
--metrics-export-port``), which the dashboard's Grafana panels read. The counter counts examples as
trained, so steps re-run after a restart count again; the ledger is the exact record.

Example (rank 0, inside the step)::

    exported = GovernanceMetrics(experiment="digits-governed", trial="digits-governed-trial3-1a2b")
    exported.record_step(step_rows(schedule, step).corpus_examples(), governor.masked_fraction())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from ray.util import metrics

from govray.governance.memorization import MemorizationReport

TRIAL_TAGS = ("experiment", "trial")


@dataclass(frozen=True)
class _Instruments:
    examples: metrics.Counter
    masked_fraction: metrics.Gauge
    memorization_score: metrics.Gauge
    corpus_memorization: metrics.Gauge


@cache
def _instruments() -> _Instruments:
    """One set per process: trials that share a process (local mode, Tune actors) share them."""
    return _Instruments(
        examples=metrics.Counter(
            "govray_examples",
            description="Training examples per corpus and route (as trained: re-run steps count again).",
            tag_keys=(*TRIAL_TAGS, "corpus", "route"),
        ),
        masked_fraction=metrics.Gauge(
            "govray_masked_fraction",
            description="Fraction of trainable parameter elements no slot of the last step could update.",
            tag_keys=TRIAL_TAGS,
        ),
        memorization_score=metrics.Gauge(
            "govray_memorization_score",
            description="memorization_score of the last validation.",
            tag_keys=TRIAL_TAGS,
        ),
        corpus_memorization=metrics.Gauge(
            "govray_corpus_memorization",
            description="A monitored corpus's normalized memorization score at the last validation.",
            tag_keys=(*TRIAL_TAGS, "corpus"),
        ),
    )


class GovernanceMetrics:
    """Rank 0's exported governance counters of one trial (see the module doc)."""

    def __init__(self, experiment: str, trial: str) -> None:
        self.instruments = _instruments()
        self.tags = {"experiment": experiment, "trial": trial}
        self._route_tags: dict[tuple[str, str], dict[str, str]] = {}

    def record_step(self, examples: Mapping[tuple[str, str], int], masked_fraction: float) -> None:
        """One step: every slot's examples by (corpus, route), and the step's masked fraction."""
        for key, count in examples.items():
            self.instruments.examples.inc(count, tags=self._tags(key))
        self.instruments.masked_fraction.set(masked_fraction, tags=self.tags)

    def record_memorization(self, report: MemorizationReport) -> None:
        self.instruments.memorization_score.set(report.score, tags=self.tags)
        for corpus, verdict in report.corpora.items():
            self.instruments.corpus_memorization.set(verdict.score, tags={**self.tags, "corpus": corpus})

    def _tags(self, key: tuple[str, str]) -> dict[str, str]:
        tags = self._route_tags.get(key)
        if tags is None:
            tags = self._route_tags[key] = {**self.tags, "corpus": key[0], "route": key[1]}
        return tags
