"""Per-example membership detectors: pure functions of a model's logits, losses and texts.

Each scores one example; a higher or a lower score is evidence that the example was trained on,
as ``MEMBER_DIRECTION`` says. The memorization probe compares a corpus's training rows with its
held-out rows (``detector_gap``); ``jobs/benchmarks/memorization_detectors.py`` measures how well
each separates seen from unseen rows (AUROC).

- **Min-K% Prob** (Shi et al. 2023, ``min_k_prob``): the mean log-probability of the ``k`` lowest
  fraction of an example's tokens; a trained example has fewer surprising tokens (higher);
- **Min-K%++** (Zhang et al. 2024, ``min_k_plus_plus``): the same mean over each token's
  log-probability standardized by the model's own next-token distribution,
  ``(log p(x_t) - mu_t) / sigma_t`` with ``mu_t = E_{z~p}[log p(z)]`` and
  ``sigma_t^2 = Var_{z~p}[log p(z)]``: a trained token is a mode of its distribution (higher);
- **zlib ratio** (Carlini et al. 2021, ``zlib_ratio``): the example's NLL in bits over its
  zlib-compressed length in bits; text the model finds easier than its compressibility explains
  was seen (lower);
- **reference-calibrated loss** (``reference_calibrated``): the loss minus the loss of a
  reference model (the run's initial weights): what training changed for this example (lower);
- **loss** (Yeom et al. 2018) and **confidence** (``confidence``: the probability of the target;
  a classifier's label, a sequence's mean over tokens): lower loss, higher confidence.

A classifier's logits ``[batch, classes]`` with targets ``[batch]`` are one token per example.

Example::

    logits = model(inputs)                       # [batch, length, vocabulary]
    scores = min_k_plus_plus(logits, targets, targets != PAD)
    gap = detector_gap("min_k_plus_plus", scores[trained], scores[held_out])  # > 0: memorized
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from govray.governance.memorization_thresholds import Detector

_FLAT = 1e-9  # a std of log p(z) below this is rounding (float64 log-softmax: ~1e-15 * |log p|)
DEFAULT_K = 0.2  # the fraction of lowest tokens Min-K% and Min-K%++ average (both papers' 20%)

# +1: a trained example scores higher; -1: lower.
MEMBER_DIRECTION: dict[Detector, int] = {
    "loss": -1,
    "min_k_prob": 1,
    "min_k_plus_plus": 1,
    "zlib_ratio": -1,
    "reference_loss": -1,
    "confidence": 1,
}


def _tokens(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 log-softmax ``[batch, length, vocabulary]``, targets and mask ``[batch, length]``
    (a classifier's ``[batch, classes]`` is one token per example)."""
    if logits.dim() == 2:
        logits, targets = logits.unsqueeze(1), targets.unsqueeze(1)
        mask = None if mask is None else mask.unsqueeze(1)
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: expected "
            "[batch, length, vocabulary] and [batch, length], or [batch, classes] and [batch]"
        )
    mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    log_probs = torch.log_softmax(logits.detach().to(torch.float64), dim=-1)
    return log_probs, targets.masked_fill(~mask, 0), mask


def _mean_of_lowest(values: torch.Tensor, mask: torch.Tensor, k: float) -> torch.Tensor:
    """Per row, the mean of the ``max(1, floor(k * n))`` lowest of its ``n`` masked values."""
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k must be in (0, 1], got {k}")
    counts = (mask.sum(dim=1) * k).floor().clamp(min=1)
    ordered = values.masked_fill(~mask, math.inf).sort(dim=1).values
    taken = torch.arange(values.shape[1], device=values.device) < counts.unsqueeze(1)
    return ordered.masked_fill(~taken, 0.0).sum(dim=1) / counts


@dataclass(frozen=True)
class TokenStats:
    """What every logit detector needs of a sequence's tokens, float64 ``[batch, length]`` each:
    ``log_p`` = ``log p(x_t)`` of the target, ``mu``/``sigma`` = mean and standard deviation of
    ``log p(z)``, ``z ~ p`` (Min-K%++), and ``mask`` (bool: the token counts). Small where the
    logits ``[batch, length, vocabulary]`` are not: a trial with a large vocabulary computes it a
    chunk of positions at a time (``token_stats`` per chunk, then ``TokenStats.cat``) and never
    holds a sequence's logits."""

    log_p: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[TokenStats]) -> TokenStats:
        """The chunks ``parts`` (consecutive positions of the same rows) as one."""
        return TokenStats(
            *(
                torch.cat([getattr(part, name) for part in parts], dim=1)
                for name in ("log_p", "mu", "sigma", "mask")
            )
        )


def token_stats(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> TokenStats:
    """The per-token statistics of ``logits`` for ``targets`` (masked-out tokens: 0)."""
    log_probs, targets, mask = _tokens(logits, targets, mask)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = log_probs.exp()
    mu = (probs * log_probs).sum(dim=-1)
    sigma = (probs * (log_probs - mu.unsqueeze(-1)).square()).sum(dim=-1).sqrt()
    zero = torch.zeros_like(chosen)
    return TokenStats(
        torch.where(mask, chosen, zero), torch.where(mask, mu, zero), torch.where(mask, sigma, zero), mask
    )


def _stats(
    logits: torch.Tensor | TokenStats, targets: torch.Tensor | None, mask: torch.Tensor | None
) -> TokenStats:
    """``logits``' token statistics (given, or computed), each example with a token to score."""
    if isinstance(logits, TokenStats):
        stats = logits
    elif targets is None:
        raise ValueError("logits need their targets")
    else:
        stats = token_stats(logits, targets, mask)
    if not bool(stats.mask.any(dim=1).all()):
        raise ValueError("an example has no token to score (its mask is all False)")
    return stats


def token_log_probs(
    logits: torch.Tensor | TokenStats, targets: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``log p(x_t)`` of each target token, float64 ``[batch, length]`` (0 where masked out)."""
    return _stats(logits, targets, mask).log_p


def min_k_prob(
    logits: torch.Tensor | TokenStats,
    targets: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    k: float = DEFAULT_K,
) -> torch.Tensor:
    """Min-K% Prob of each example: the mean ``log p(x_t)`` of its lowest ``k`` fraction of tokens
    (at least one). Higher: trained.

    >>> logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    >>> round(float(min_k_prob(logits, torch.tensor([[0, 0]]), k=0.5)), 4)  # log 0.5
    -0.6931
    """
    stats = _stats(logits, targets, mask)
    return _mean_of_lowest(stats.log_p, stats.mask, k)


def min_k_plus_plus(
    logits: torch.Tensor | TokenStats,
    targets: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    k: float = DEFAULT_K,
) -> torch.Tensor:
    """Min-K%++ of each example: the mean of the lowest ``k`` fraction of its tokens' standardized
    log-probabilities ``(log p(x_t) - mu_t) / sigma_t`` under the model's next-token
    distribution ``p`` (``mu_t``, ``sigma_t``: mean and standard deviation of ``log p(z)``,
    ``z ~ p``). Higher: trained. A uniform distribution (``sigma_t`` 0, or at float64 rounding
    level: below ``_FLAT``) scores its tokens 0.
    """
    stats = _stats(logits, targets, mask)
    flat = stats.sigma <= _FLAT  # rounding of the log-softmax, not spread: the token is as likely as any
    standardized = torch.where(
        flat, torch.zeros_like(stats.mu), (stats.log_p - stats.mu) / stats.sigma.clamp(min=_FLAT)
    )
    return _mean_of_lowest(standardized, stats.mask, k)


def confidence(
    logits: torch.Tensor | TokenStats, targets: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The probability the model gives each example's target (a sequence: the mean over its
    tokens). Higher: trained."""
    stats = _stats(logits, targets, mask)
    return stats.log_p.exp().masked_fill(~stats.mask, 0.0).sum(dim=1) / stats.mask.sum(dim=1)


def zlib_ratio(nll_nats: torch.Tensor, texts: Sequence[str]) -> torch.Tensor:
    """Each text's total NLL (nats, summed over its tokens) in bits over its zlib-compressed
    length in bits (level 9, UTF-8): the bits the model needs per bit zlib needs. Lower: trained.
    """
    if nll_nats.dim() != 1 or nll_nats.numel() != len(texts):
        raise ValueError(f"{nll_nats.numel()} losses for {len(texts)} texts")
    compressed = torch.tensor(
        [8.0 * len(zlib.compress(text.encode("utf-8"), 9)) for text in texts], dtype=torch.float64
    )
    return nll_nats.detach().to(torch.float64).cpu() / math.log(2.0) / compressed


def reference_calibrated(losses: torch.Tensor, reference_losses: torch.Tensor) -> torch.Tensor:
    """Each example's loss minus its loss under the reference model (the run's initial weights):
    how much training lowered it. Lower: trained."""
    if losses.shape != reference_losses.shape:
        raise ValueError(f"losses {tuple(losses.shape)} and reference losses {tuple(reference_losses.shape)}")
    return losses.detach().to(torch.float64) - reference_losses.detach().to(torch.float64)


def detector_gap(detector: Detector, training: torch.Tensor, holdout: torch.Tensor) -> float:
    """How far a corpus's training rows lean towards "trained" on ``detector``: the difference of
    the two means, signed so that > 0 is memorization (for ``loss``, the loss gap)."""
    if training.numel() == 0 or holdout.numel() == 0:
        raise ValueError(f"{detector}: no training or no held-out scores")
    return gap_of_means(
        detector, float(training.to(torch.float64).mean()), float(holdout.to(torch.float64).mean())
    )


def gap_of_means(detector: Detector, training_mean: float, holdout_mean: float) -> float:
    """``detector_gap`` from the two means (what the probe has after summing across ranks)."""
    return MEMBER_DIRECTION[detector] * (training_mean - holdout_mean)


def predicted(
    given: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | TokenStats | None,
) -> tuple[torch.Tensor | TokenStats | None, torch.Tensor | None, torch.Tensor | None]:
    """A trial's ``predictions`` (logits, targets, mask; their ``TokenStats``; or None) as
    ``example_scores``' ``logits``, ``targets`` and ``mask``."""
    if isinstance(given, TokenStats):
        return given, None, None
    return given or (None, None, None)


def example_scores(
    losses: torch.Tensor,
    logits: torch.Tensor | TokenStats | None = None,
    targets: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    reference_losses: torch.Tensor | None = None,
    texts: Sequence[str] | None = None,
) -> dict[Detector, torch.Tensor]:
    """Every detector that the given inputs allow, float64 ``[batch]`` each: ``loss`` always; the
    logit detectors with ``logits`` and ``targets``; ``reference_loss`` with ``reference_losses``;
    ``zlib_ratio`` with logits and ``texts`` (the NLL it divides is the tokens' summed NLL).
    ``logits`` may be their ``TokenStats`` instead (then without ``targets`` and ``mask``)."""
    scores: dict[Detector, torch.Tensor] = {"loss": losses.detach().to(torch.float64).cpu()}
    if reference_losses is not None:
        scores["reference_loss"] = reference_calibrated(scores["loss"], reference_losses.cpu())
    if isinstance(logits, TokenStats) or (logits is not None and targets is not None):
        stats = _stats(logits, targets, mask)
        scores["min_k_prob"] = min_k_prob(stats).cpu()
        scores["min_k_plus_plus"] = min_k_plus_plus(stats).cpu()
        scores["confidence"] = confidence(stats).cpu()
        if texts is not None:
            scores["zlib_ratio"] = zlib_ratio(-stats.log_p.sum(dim=-1).cpu(), texts)
    return scores
