"""The memorization thresholds a policy sets: their own module, without torch, because every
reader of a policy (the CLI, ingest tasks on every Ray worker) loads them while only a training
process measures memorization (``govray.governance.memorization``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MemorizationThresholds(BaseModel):
    """The policy's memorization thresholds and what a flag does.

    ``entropy_drop`` is in bits below the calibrated band (1 bit halves the effective rank);
    None measures and reports the entropy profile without letting it raise a flag (it has no
    published validation, and detected neither memorization govray's studies ran: canaries in
    ``jobs/benchmarks/memorization_study.py``, random labels in ``memorization_digits.py``; see
    BENCHMARKS.md). ``exposure_bits`` must be reachable: the rank definition tops out at
    log2(references + 1) bits (about 10 for the default 1,000 references).
    ``monitored_corpora`` None monitors every corpus measured.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss_gap: float = Field(default=0.5, gt=0.0)
    exposure_bits: float = Field(default=8.0, gt=0.0)
    entropy_drop: float | None = Field(default=1.0, gt=0.0)
    action: Literal["flag", "gate", "rollback"] = "flag"
    monitored_corpora: list[str] | None = None
