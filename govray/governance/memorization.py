"""Memorization measures: pure, deterministic functions of a model's outputs.

The training loop computes per-example losses, canary scores and hidden representations; this
module turns them into these measures and one number per evaluation:

- **entropy profile** — the Shannon entropy (bits) of the normalized singular-value spectrum of
  each monitored layer's representation on a probe batch, checked against a band calibrated on
  held-out rows (``spectral_entropy``, ``entropy_profile``, ``EntropyBand``);
- **canary exposure** — Carlini et al., "The Secret Sharer" (2019) (``exposure``,
  ``extrapolated_exposure``, ``mean_exposure``);
- **loss gap** — Yeom et al. (2018): mean held-out loss - mean training loss (``loss_gap``);
- **detector gaps** — the per-example detectors of ``govray.governance.detectors`` (Min-K%,
  Min-K%++, zlib ratio, reference-calibrated loss, confidence), training rows against held-out rows;
- **memorization score** — the largest threshold-normalized measure over monitored corpora
  (``memorization_report``), and the search ``objective`` that penalizes it.

Example::

    band = EntropyBand.calibrate([entropy_profile(h) for h in holdout_probe_representations])
    check = band.check(training=entropy_profile(train_h), holdout=entropy_profile(holdout_h))
    measures = CorpusMeasures(
        loss_gap=loss_gap(train_losses, holdout_losses),
        exposure_bits=mean_exposure(canary_scores, reference_scores),
        entropy_drop=check.drop_bits,
    )
    report = memorization_report({"news-2024": measures}, policy_thresholds)
    value = objective(validation_loss, report.score, lam=0.1, smaller_is_better=True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeAlias

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from govray.governance.memorization_thresholds import DETECTOR_THRESHOLDS
from govray.governance.memorization_thresholds import MemorizationThresholds as MemorizationThresholds

_STRICT = ConfigDict(extra="forbid", frozen=True)

Scores: TypeAlias = Sequence[float] | torch.Tensor
EntropyProfile: TypeAlias = dict[str, float]  # layer name → spectral entropy (bits) on a probe batch

DEFAULT_MIN_BAND_WIDTH = 0.1  # bits; see EntropyBand.calibrate


def _as_float64(values: Scores, what: str) -> torch.Tensor:
    tensor = torch.as_tensor(values, dtype=torch.float64).flatten()
    if tensor.numel() == 0:
        raise ValueError(f"{what} is empty")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds a NaN or infinite value")
    return tensor


# --- entropy profile ----------------------------------------------------------------------------


def spectral_entropy(h: torch.Tensor) -> float:
    """Shannon entropy (bits) of the normalized singular-value spectrum of ``h``, centered per feature.

    ``h`` holds one row per example (trailing dimensions are flattened into features). With ``s``
    the singular values of the centered matrix, ``p_i = s_i / Σ s_j`` and the entropy is
    ``-Σ p_i log2 p_i`` (``0·log 0 = 0``): ``log2 r`` for ``r`` equal singular values, 0 for
    rank 1. Computed in float64. Singular values at rounding level are zero: below
    ``max(n, d) · eps · ‖h‖_F``, the tolerance ``matrix_rank`` uses, with ``eps`` of ``h``'s own
    dtype (a float32 activation resolves nothing finer) and ``‖h‖_F`` of the uncentered ``h`` (so
    centering's rounding error does not count as spectrum). A collapsed representation (every
    row equal, so the centered matrix is zero) has entropy 0.0.

    >>> spectral_entropy(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]))
    1.0
    """
    if h.dim() < 2 or h.shape[0] < 2:
        raise ValueError(
            f"spectral_entropy needs at least 2 examples (rows), got a tensor of shape {tuple(h.shape)}"
        )
    matrix = h.detach().to(torch.float64).reshape(h.shape[0], -1)
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError("spectral_entropy: the representation holds a NaN or infinite value")
    eps = torch.finfo(h.dtype if h.dtype.is_floating_point else torch.float64).eps
    tolerance = max(matrix.shape) * eps * float(torch.linalg.norm(matrix))
    singular = torch.linalg.svdvals(matrix - matrix.mean(dim=0, keepdim=True))
    singular = singular[singular > tolerance]
    if singular.numel() == 0:
        return 0.0
    p = singular / singular.sum()
    # max(): a single singular value gives -(1·log2 1) = -0.0, reported as 0.0.
    return max(0.0, float(-(p * torch.log2(p)).sum()))


def entropy_profile(representations: Mapping[str, torch.Tensor]) -> EntropyProfile:
    """Spectral entropy of each layer's representation (layer name → examples x features) on a probe batch."""
    return {layer: spectral_entropy(h) for layer, h in representations.items()}


class LayerBand(BaseModel):
    """The calibrated range of one layer's entropy (bits) on held-out rows."""

    model_config = _STRICT

    mean: float
    lower: float
    upper: float

    @property
    def width(self) -> float:
        return self.upper - self.lower


class EntropyCheck(BaseModel):
    """The entropy-profile flag of one corpus at one evaluation.

    ``triggered``: layer → depth below the band, ``(lower - training value) / band width`` (> 0),
    for each layer where the training-row entropy is below the band while the held-out-row entropy
    is not. ``drop_bits``: the largest ``lower - training value`` over triggered layers (0.0 when
    none) — the corpus's ``entropy_drop`` for ``memorization_report``.
    """

    model_config = _STRICT

    triggered: dict[str, float]
    drop_bits: float = Field(ge=0.0)

    @property
    def flagged(self) -> bool:
        return bool(self.triggered)


class EntropyBand(BaseModel):
    """Per-layer entropy bands calibrated on held-out rows of one corpus."""

    model_config = _STRICT

    layers: dict[str, LayerBand]

    @classmethod
    def calibrate(
        cls,
        holdout_profiles: Sequence[Mapping[str, float]],
        k: float = 3.0,
        min_width: float = DEFAULT_MIN_BAND_WIDTH,
    ) -> EntropyBand:
        """Band per layer: mean ± max(k · std, min_width / 2) over ``holdout_profiles``.

        ``std`` uses ddof=1 (0 for a single profile). ``min_width`` (bits) floors the band's full
        width, so held-out profiles that happen to agree exactly do not give a zero-width band that
        any rounding difference would fall out of.
        """
        if not holdout_profiles:
            raise ValueError("EntropyBand.calibrate needs at least one held-out profile")
        if k <= 0 or min_width <= 0:
            raise ValueError(f"EntropyBand.calibrate: k and min_width must be > 0, got {k} and {min_width}")
        layers = set(holdout_profiles[0])
        for index, profile in enumerate(holdout_profiles):
            if set(profile) != layers:
                raise ValueError(
                    f"held-out profile {index} has layers {sorted(profile)}, profile 0 has {sorted(layers)}"
                )
        bands = {}
        for layer in sorted(layers):
            values = torch.tensor([profile[layer] for profile in holdout_profiles], dtype=torch.float64)
            std = float(values.std(correction=1)) if values.numel() >= 2 else 0.0
            half = max(k * std, min_width / 2)
            mean = float(values.mean())
            bands[layer] = LayerBand(mean=mean, lower=mean - half, upper=mean + half)
        return cls(layers=bands)

    def check(self, training: Mapping[str, float], holdout: Mapping[str, float]) -> EntropyCheck:
        """Flag the layers where ``training`` is below the band and ``holdout`` is not.

        Both below means the representation changed for every row, which is not memorization of
        the training rows. Every calibrated layer must be in both profiles.
        """
        for name, profile in (("training", training), ("held-out", holdout)):
            missing = sorted(set(self.layers) - set(profile))
            if missing:
                raise ValueError(f"the {name} profile lacks calibrated layers {missing}")
        triggered: dict[str, float] = {}
        drop = 0.0
        for layer, band in self.layers.items():
            if training[layer] < band.lower <= holdout[layer]:
                triggered[layer] = (band.lower - training[layer]) / band.width
                drop = max(drop, band.lower - training[layer])
        return EntropyCheck(triggered=triggered, drop_bits=drop)


# --- canary exposure ----------------------------------------------------------------------------


def canary_rank(canary_score: float, reference_scores: Scores) -> float:
    """1 + the number of references scoring strictly lower (more likely) than the canary.

    A reference scoring exactly the canary's score counts one half, so a tie is neither
    memorization nor its absence and the rank stays in [1, |R| + 1].
    """
    if not math.isfinite(canary_score):
        raise ValueError(f"canary score must be finite, got {canary_score}")
    references = _as_float64(reference_scores, "reference scores")
    lower = int((references < canary_score).sum())
    ties = int((references == canary_score).sum())
    return 1.0 + lower + 0.5 * ties


def exposure(canary_score: float, reference_scores: Scores) -> float:
    """Exposure in bits: ``log2(|R| + 1) - log2(rank)`` (Carlini et al. 2019).

    Scores are losses or log-perplexities (lower = more likely); the references are candidates
    from the canary's format never trained on. A canary scoring below every reference gets the
    maximum ``log2(|R| + 1)``; an untrained canary (uniform rank) averages
    ``log2(|R| + 1) - log2((|R| + 1)!) / (|R| + 1)``, which tends to ``log2 e ≈ 1.44`` bits.
    """
    references = _as_float64(reference_scores, "reference scores")
    return math.log2(references.numel() + 1) - math.log2(canary_rank(canary_score, references))


def extrapolated_exposure(canary_score: float, reference_scores: Scores) -> float:
    """Exposure in bits by Carlini's extrapolation: ``-log2 Phi((score - mu) / sigma)``.

    ``mu`` and ``sigma`` (ddof=1) fit a normal distribution to the reference scores; ``Phi`` is its
    CDF, evaluated in log space (``torch.special.log_ndtr``) so a canary far below every reference
    gets a large finite exposure instead of the rank definition's ceiling ``log2(|R| + 1)``. A
    canary at the reference mean gets 1 bit.
    """
    if not math.isfinite(canary_score):
        raise ValueError(f"canary score must be finite, got {canary_score}")
    references = _as_float64(reference_scores, "reference scores")
    if references.numel() < 2:
        raise ValueError("extrapolated exposure needs at least 2 reference scores to fit a normal")
    sigma = float(references.std(correction=1))
    if sigma == 0.0:
        raise ValueError("extrapolated exposure: every reference has the same score (sigma = 0)")
    z = torch.tensor((canary_score - float(references.mean())) / sigma, dtype=torch.float64)
    return max(0.0, float(-torch.special.log_ndtr(z)) / math.log(2.0))


def mean_exposure(
    canary_scores: Scores,
    reference_scores: Scores,
    measure: Callable[[float, Scores], float] = exposure,
) -> float:
    """Mean exposure of the canaries inserted in one corpus, each against the same references."""
    canaries = _as_float64(canary_scores, "canary scores")
    references = _as_float64(reference_scores, "reference scores")
    return sum(measure(float(score), references) for score in canaries) / canaries.numel()


# --- loss gap -----------------------------------------------------------------------------------


def loss_gap(train_losses: Scores, holdout_losses: Scores) -> float:
    """Mean held-out loss - mean training loss of one corpus (Yeom et al. 2018); > 0 when memorizing."""
    train = _as_float64(train_losses, "training losses")
    holdout = _as_float64(holdout_losses, "held-out losses")
    return float(holdout.mean()) - float(train.mean())


# --- score, report, objective -------------------------------------------------------------------


class CorpusMeasures(BaseModel):
    """The measures computed for one corpus at one evaluation; None = not computed."""

    model_config = _STRICT

    loss_gap: float | None = None
    # detector gaps (``detectors.detector_gap``: training sample vs held-out rows, > 0 memorizing)
    min_k_prob: float | None = None
    min_k_plus_plus: float | None = None
    zlib_ratio: float | None = None
    reference_loss: float | None = None
    confidence_gap: float | None = None
    exposure_bits: float | None = Field(default=None, ge=0.0)
    entropy_drop: float | None = Field(default=None, ge=0.0)  # EntropyCheck.drop_bits


class CorpusVerdict(BaseModel):
    """One corpus in a report: its raw measures, each divided by its threshold, and the flag."""

    model_config = _STRICT

    measures: CorpusMeasures
    normalized: dict[str, float]  # measure name → max(0, value / threshold), computed measures only
    score: float = Field(ge=0.0)  # max of normalized (0.0 when none was computed)
    flagged: bool  # score ≥ 1: some measure reached its threshold

    @model_validator(mode="after")
    def _consistent(self) -> CorpusVerdict:
        if self.flagged != (self.score >= 1.0):
            raise ValueError(f"flagged={self.flagged} contradicts score={self.score}")
        return self


class MemorizationReport(BaseModel):
    """One evaluation's memorization verdict (JSON-serializable; kept in checkpoints and attestations)."""

    model_config = _STRICT

    corpora: dict[str, CorpusVerdict]
    score: float = Field(ge=0.0)  # memorization_score: max of the corpora's scores, 0.0 when none
    flagged: list[str]  # sorted
    thresholds: MemorizationThresholds

    @property
    def action(self) -> Literal["flag", "gate", "rollback"]:
        """What the policy says a flag does (applied to each corpus in ``flagged``)."""
        return self.thresholds.action


def memorization_report(
    per_corpus: Mapping[str, CorpusMeasures], thresholds: MemorizationThresholds
) -> MemorizationReport:
    """Normalize each monitored corpus's measures by their thresholds and take the largest.

    For corpus c, ``m_c = max(gap / loss_gap, ..., exposure / exposure_bits, drop / entropy_drop)``
    over the measures computed for c whose thresholds are set (the loss gap, each detector's gap,
    canary exposure, the entropy drop), each clipped below at 0 (a negative gap is no evidence and
    must not reward a trial in the objective). c is flagged
    when ``m_c ≥ 1``. The ``memorization_score`` is ``max_c m_c`` over monitored corpora, 0.0
    when none is monitored. A monitored corpus absent from ``per_corpus`` is refused rather than
    silently unmonitored.
    """
    monitored = list(per_corpus) if thresholds.monitored_corpora is None else thresholds.monitored_corpora
    missing = sorted(set(monitored) - set(per_corpus))
    if missing:
        raise ValueError(f"monitored corpora {missing} have no measures in this evaluation")
    limits = {
        **{name: getattr(thresholds, name) for name in DETECTOR_THRESHOLDS.values()},
        "exposure_bits": thresholds.exposure_bits,
        "entropy_drop": thresholds.entropy_drop,
    }
    verdicts = {}
    for corpus in sorted(monitored):
        measures = per_corpus[corpus]
        normalized = {
            name: max(0.0, value / limit)
            for name, limit in limits.items()
            if limit is not None and (value := getattr(measures, name)) is not None
        }
        score = max(normalized.values(), default=0.0)
        verdicts[corpus] = CorpusVerdict(
            measures=measures, normalized=normalized, score=score, flagged=score >= 1.0
        )
    return MemorizationReport(
        corpora=verdicts,
        score=max((verdict.score for verdict in verdicts.values()), default=0.0),
        flagged=[corpus for corpus, verdict in verdicts.items() if verdict.flagged],
        thresholds=thresholds,
    )


def objective(metric: float, score: float, lam: float, smaller_is_better: bool) -> float:
    """The search objective: ``metric + λ·score`` when smaller is better, ``metric - λ·score`` otherwise.

    Either way the penalty moves a memorizer's objective in the worse direction, so ASHA and PBT
    prune it; λ = 0 leaves the metric unchanged.
    """
    if lam < 0:
        raise ValueError(f"objective: λ must be ≥ 0, got {lam}")
    penalty = lam * score
    return metric + penalty if smaller_is_better else metric - penalty
