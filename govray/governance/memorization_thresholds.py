"""The memorization thresholds a policy sets: their own module, without torch, because every
reader of a policy (the CLI, ingest tasks on every Ray worker) loads them while only a training
process measures memorization (``govray.governance.memorization``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The per-example detectors (``govray.governance.detectors``), and the threshold field of each
# one's corpus gap (training rows vs held-out rows, > 0 when memorizing).
Detector = Literal["loss", "min_k_prob", "min_k_plus_plus", "zlib_ratio", "reference_loss", "confidence"]
DETECTOR_THRESHOLDS: dict[Detector, str] = {
    "loss": "loss_gap",
    "min_k_prob": "min_k_prob",
    "min_k_plus_plus": "min_k_plus_plus",
    "zlib_ratio": "zlib_ratio",
    "reference_loss": "reference_loss",
    "confidence": "confidence_gap",
}


class MemorizationThresholds(BaseModel):
    """The policy's memorization thresholds and what a flag does.

    A threshold set to None measures and reports its detector without letting it raise a flag.
    Each detector's threshold bounds its corpus gap (``detectors.detector_gap``: mean over the
    training sample - mean over held-out rows, signed so that > 0 is memorization), in the
    detector's units: ``loss_gap`` and ``reference_loss`` in nats, ``min_k_prob`` in nats of
    log-probability, ``min_k_plus_plus`` in standard deviations, ``zlib_ratio`` in model bits per
    zlib bit, ``confidence_gap`` in probability.

    The defaults are the detectors measured to separate seen from unseen rows with AUROC >= 0.9 on
    both of govray's memorization workloads, with thresholds that no clean control reached
    (``jobs/benchmarks/memorization_detectors.py``; BENCHMARKS.md, "Issue 35"). ``entropy_drop``
    (bits below the calibrated band; 1 bit halves the effective rank) is off by default: it
    detected neither workload's memorization (``memorization_study.py``,
    ``memorization_digits.py``). ``exposure_bits`` must be reachable: the rank definition tops out
    at log2(references + 1) bits (about 10 for the default 1,000 references).
    ``monitored_corpora`` None monitors every corpus measured.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss_gap: float | None = Field(default=0.5, gt=0.0)
    min_k_prob: float | None = Field(default=0.5, gt=0.0)
    min_k_plus_plus: float | None = Field(default=None, gt=0.0)  # AUROC 0.83 on random labels
    zlib_ratio: float | None = Field(default=None, gt=0.0)  # text only: unmeasured on a classifier
    reference_loss: float | None = Field(default=0.5, gt=0.0)
    confidence_gap: float | None = Field(default=0.1, gt=0.0)
    exposure_bits: float = Field(default=8.0, gt=0.0)
    entropy_drop: float | None = Field(default=None, gt=0.0)
    action: Literal["flag", "gate", "rollback"] = "flag"
    monitored_corpora: list[str] | None = None

    def detector_limits(self) -> dict[Detector, float | None]:
        """Each per-example detector's threshold (None: reported, never flags)."""
        return {detector: getattr(self, field) for detector, field in DETECTOR_THRESHOLDS.items()}
