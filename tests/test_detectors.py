"""The per-example memorization detectors (``govray.governance.detectors``) on cases whose answer is
known: hand-computed logits, a sequence a tiny model was overfit on against a fresh one, labels
only memorizing can fit; and the AUROC the detectors' benchmark chooses the defaults by."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from govray.governance.detectors import (
    MEMBER_DIRECTION,
    confidence,
    detector_gap,
    example_scores,
    min_k_plus_plus,
    min_k_prob,
    reference_calibrated,
    token_log_probs,
    zlib_ratio,
)
from govray.governance.memorization import CorpusMeasures, MemorizationThresholds, memorization_report
from jobs.benchmarks.memorization_detectors import (
    auroc,
    default_detectors,
    digits_run,
    raised,
    text_run,
    tpr_at_fpr,
)
from jobs.examples.text.trial import PAD, CharTransformerTrial, encode


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train in a fraction of a second on one thread; on a loaded machine, OpenMP's
    threads wait on each other for most of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def probabilities(*rows: list[float]) -> torch.Tensor:
    """Logits ``[1, len(rows), classes]`` whose softmax is exactly ``rows``."""
    return torch.log(torch.tensor([rows], dtype=torch.float64))


# --- hand-computed cases ------------------------------------------------------------------------


def test_min_k_prob_averages_the_lowest_fraction_of_token_log_probabilities() -> None:
    logits = probabilities([0.5, 0.5], [0.9, 0.1], [0.8, 0.2], [0.25, 0.75])
    targets = torch.tensor([[0, 0, 0, 0]])  # token probabilities 0.5, 0.9, 0.8, 0.25
    assert float(min_k_prob(logits, targets, k=0.5)) == pytest.approx((math.log(0.25) + math.log(0.5)) / 2)
    assert float(min_k_prob(logits, targets, k=0.1)) == pytest.approx(math.log(0.25))  # at least one token
    everything = (math.log(0.5) + math.log(0.9) + math.log(0.8) + math.log(0.25)) / 4
    assert float(min_k_prob(logits, targets, k=1.0)) == pytest.approx(everything)


def test_masked_tokens_are_never_among_the_lowest() -> None:
    logits = probabilities([0.5, 0.5], [0.01, 0.99])
    targets = torch.tensor([[0, 0]])
    mask = torch.tensor([[True, False]])  # the 0.01 token is padding
    assert float(min_k_prob(logits, targets, mask, k=1.0)) == pytest.approx(math.log(0.5))
    assert float(token_log_probs(logits, targets, mask)[0, 1]) == 0.0


@pytest.mark.parametrize("p", [0.9, 0.6, 0.2])
def test_min_k_plus_plus_standardizes_by_the_models_own_distribution(p: float) -> None:
    # Two outcomes with probabilities p, 1-p: log p(z) takes two values, so the standardized
    # log-probability of the first is ±sqrt((1-p)/p), + when it is the likelier, and of the
    # second ∓sqrt(p/(1-p)).
    logits = probabilities([p, 1 - p])
    first = float(min_k_plus_plus(logits, torch.tensor([[0]]), k=1.0))
    second = float(min_k_plus_plus(logits, torch.tensor([[1]]), k=1.0))
    assert first == pytest.approx(math.copysign(math.sqrt((1 - p) / p), p - 0.5))
    assert second == pytest.approx(math.copysign(math.sqrt(p / (1 - p)), 0.5 - p))


def test_min_k_plus_plus_of_a_uniform_distribution_is_zero() -> None:
    uniform = torch.zeros(2, 3, 5)
    assert torch.equal(
        min_k_plus_plus(uniform, torch.zeros(2, 3, dtype=torch.long)), torch.zeros(2, dtype=torch.float64)
    )


def test_a_classifiers_logits_are_one_token_per_example() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    labels = torch.tensor([0, 1])
    assert torch.allclose(min_k_prob(logits, labels), torch.log(torch.tensor([0.7, 0.1])).double())
    assert torch.allclose(confidence(logits, labels), torch.tensor([0.7, 0.1], dtype=torch.float64))


def test_zlib_ratio_is_model_bits_over_compressed_bits() -> None:
    import zlib

    texts = ["abababababababab", "qwe9rtz1uiop2asd"]
    nll = torch.tensor([8.0, 8.0])
    expected = [8.0 / math.log(2) / (8 * len(zlib.compress(t.encode(), 9))) for t in texts]
    assert zlib_ratio(nll, texts).tolist() == pytest.approx(expected)
    assert expected[0] > expected[1]  # the same NLL on the more compressible text: less surprising


def test_reference_calibration_subtracts_the_reference_loss() -> None:
    calibrated = reference_calibrated(torch.tensor([0.5, 2.0]), torch.tensor([2.0, 2.0]))
    assert calibrated.tolist() == [-1.5, 0.0]


def test_the_gap_is_positive_when_training_rows_lean_trained_whatever_the_direction() -> None:
    low, high = torch.tensor([0.1, 0.3]), torch.tensor([1.0, 1.2])
    assert detector_gap("loss", low, high) == pytest.approx(0.9)  # the loss gap
    assert detector_gap("min_k_prob", high, low) == pytest.approx(0.9)
    assert detector_gap("loss", high, low) == pytest.approx(-0.9)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no token to score"):
        min_k_prob(
            torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="k must be in"):
        min_k_prob(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), k=0.0)
    with pytest.raises(ValueError, match="expected"):
        min_k_prob(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


# --- a memorized sequence against a fresh one ---------------------------------------------------


def test_every_text_detector_tells_a_memorized_sequence_from_a_fresh_one(one_thread: None) -> None:
    """A tiny character transformer overfit on one random sequence: every detector scores that
    sequence on the trained side of a fresh sequence from the same generator."""
    torch.manual_seed(0)
    trial = CharTransformerTrial({"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 24})
    model = trial.build_model()
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    rng = np.random.default_rng(0)
    memorized, fresh = ("".join(rng.choice(list(alphabet), 24)) for _ in range(2))
    batch = {"text": encode([memorized, fresh], 24)}
    with torch.no_grad():
        initial = trial.loss(model, batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(25):
        optimizer.zero_grad()
        trial.loss(model, {"text": batch["text"][:1]}).mean().backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        logits, targets, mask = trial.predictions(model, batch)
        scores = example_scores(trial.loss(model, batch), logits, targets, mask, initial, [memorized, fresh])
    assert set(scores) == set(MEMBER_DIRECTION)
    for name, values in scores.items():
        assert MEMBER_DIRECTION[name] * (values[0] - values[1]) > 0, (name, values)
    assert bool((targets != PAD).all())  # a full row: no padding here


def test_the_classifier_detectors_tell_memorized_random_labels_from_fresh_ones(one_thread: None) -> None:
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, 8, generator=generator), torch.randint(0, 10, (60,), generator=generator)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with torch.no_grad():
        initial = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(200):  # fit the first 30 rows' random labels
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:30]), y[:30]).backward()
        optimizer.step()
    with torch.no_grad():
        logits = model(x)
        scores = example_scores(
            torch.nn.functional.cross_entropy(logits, y, reduction="none"), logits, y, None, initial
        )
    assert "zlib_ratio" not in scores  # no texts
    for name, values in scores.items():  # a fresh row's random label is the argmax 1 time in 10
        sign = MEMBER_DIRECTION[name]
        assert detector_gap(name, values[:30], values[30:]) > 0, name
        assert auroc(sign * values[:30].numpy(), sign * values[30:].numpy()) > 0.85, name


# --- the benchmark's statistics and the thresholds ---------------------------------------------


def test_auroc_counts_ties_one_half() -> None:
    assert auroc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert auroc(np.array([1.0]), np.array([2.0])) == 0.0
    assert auroc(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.5  # 1 above + 2 ties of 4 pairs
    assert auroc(np.array([2.0, 2.0, 0.0]), np.array([1.0, 2.0])) == pytest.approx((2 + 0.5 * 2) / 6)


def test_tpr_at_fpr_allows_only_the_permitted_false_positives() -> None:
    nonmembers = np.arange(200, dtype=float)  # 1% of 200: two may be above the threshold (197)
    assert tpr_at_fpr(np.array([196.0, 197.0, 198.0, 500.0]), nonmembers) == 0.5
    assert tpr_at_fpr(np.array([150.0]), np.arange(50, dtype=float)) == 1.0  # 0 allowed: above all


def test_a_detector_threshold_flags_its_corpus_and_an_unset_one_only_reports() -> None:
    measures = CorpusMeasures(loss_gap=0.1, min_k_plus_plus=0.8, zlib_ratio=3.0)
    report = memorization_report({"c": measures}, MemorizationThresholds(loss_gap=None, min_k_plus_plus=0.4))
    assert report.corpora["c"].normalized == {"min_k_plus_plus": 2.0}  # zlib has no threshold here
    assert report.flagged == ["c"]


def test_a_policy_that_names_the_entropy_threshold_still_validates_and_flags_on_it() -> None:
    old = MemorizationThresholds.model_validate({"loss_gap": 0.5, "entropy_drop": 1.0, "action": "rollback"})
    report = memorization_report({"c": CorpusMeasures(entropy_drop=1.5)}, old)
    assert report.flagged == ["c"]
    assert MemorizationThresholds().entropy_drop is None  # off by default


# --- the defaults on the benchmark's clean controls ---------------------------------------------


@pytest.mark.slow  # two in-process training runs of 1,500 steps (minutes on 2 shared cores)
def test_the_clean_controls_raise_no_flag_with_the_default_detectors(one_thread: None) -> None:
    """The text workload without its records (nothing repeated reaches the adapter) and the digits
    memorizer's model on true labels: no default detector's gap reaches its threshold at any
    measurement (``jobs/benchmarks/memorization_detectors.py`` trains and measures them)."""
    defaults = default_detectors(MemorizationThresholds())
    assert set(defaults) - {"loss"}, "a default detector besides the loss gap"
    for measured in (text_run(False, 1500, 250), digits_run(False, 1500, 250)):
        assert not any(raised(measured, defaults).values()), measured.gaps
