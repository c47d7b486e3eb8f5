"""Memorization measures: the spectral entropy profile and its band,
canary exposure (Carlini et al. 2019), the loss gap (Yeom et al. 2018), the memorization score
and the search objective that penalizes it."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from govray.governance.memorization import (
    CorpusMeasures,
    EntropyBand,
    MemorizationReport,
    MemorizationThresholds,
    canary_rank,
    entropy_profile,
    exposure,
    extrapolated_exposure,
    loss_gap,
    mean_exposure,
    memorization_report,
    objective,
    spectral_entropy,
)


def equal_spectrum(rank: int, features: int = 16, seed: int = 0) -> torch.Tensor:
    """[Q; -Q] with Q's rows orthonormal: column means are zero, and ``rank`` equal singular values."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(features, rank, generator=generator, dtype=torch.float64))
    return torch.cat([q.T, -q.T])


def expected_untrained_exposure(references: int) -> float:
    """E[log2(R + 1) - log2(rank)] for a rank uniform on 1..R+1."""
    return math.log2(references + 1) - math.lgamma(references + 2) / math.log(2) / (references + 1)


# --- spectral entropy ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 2, 3, 5, 8, 16])
def test_equal_singular_values_over_rank_r_give_exactly_log2_r(rank: int) -> None:
    h = equal_spectrum(rank)
    assert spectral_entropy(h) == pytest.approx(math.log2(rank), abs=1e-9)


def test_a_rank_one_representation_has_zero_entropy() -> None:
    # float32, as activations are: its rounding noise is below the dtype's resolution, not spectrum
    generator = torch.Generator().manual_seed(1)
    u, v = torch.randn(30, 1, generator=generator), torch.randn(1, 12, generator=generator)
    offset = torch.randn(1, 12, generator=generator)  # removed by centering
    assert spectral_entropy(u @ v + offset) == pytest.approx(0.0, abs=1e-12)


def test_spectral_entropy_ignores_row_order_and_scale() -> None:
    generator = torch.Generator().manual_seed(2)
    h = torch.randn(40, 10, generator=generator, dtype=torch.float64) @ torch.randn(
        10, 10, generator=generator, dtype=torch.float64
    )
    base = spectral_entropy(h)
    assert 0.0 < base < math.log2(10)
    assert spectral_entropy(h[torch.randperm(40, generator=generator)]) == pytest.approx(base, abs=1e-12)
    for factor in (1e-3, 7.3, 1e4):
        assert spectral_entropy(factor * h) == pytest.approx(base, abs=1e-12)


def test_a_collapsed_representation_has_entropy_zero_not_nan() -> None:
    identical_rows = torch.tensor([[0.1, 0.3, 0.7, -2.2]] * 9)  # centering leaves rounding noise only
    assert spectral_entropy(identical_rows) == 0.0
    assert spectral_entropy(torch.zeros(5, 3)) == 0.0


def test_trailing_dimensions_are_features() -> None:
    h = torch.randn(12, 3, 4, generator=torch.Generator().manual_seed(3))
    assert spectral_entropy(h) == spectral_entropy(h.reshape(12, 12))


@pytest.mark.parametrize("shape", [(1, 4), (4,), (0, 3)])
def test_spectral_entropy_refuses_fewer_than_two_examples(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="at least 2 examples"):
        spectral_entropy(torch.ones(shape))


def test_entropy_profile_is_per_layer() -> None:
    profile = entropy_profile({"fc1": equal_spectrum(4), "fc2": equal_spectrum(1)})
    assert profile == pytest.approx({"fc1": 2.0, "fc2": 0.0}, abs=1e-9)


# --- entropy band and flag ----------------------------------------------------------------------


def test_band_is_mean_plus_minus_k_sample_std() -> None:
    band = EntropyBand.calibrate([{"fc1": 2.0}, {"fc1": 3.0}, {"fc1": 4.0}], k=3.0)
    assert (band.layers["fc1"].mean, band.layers["fc1"].lower, band.layers["fc1"].upper) == (3.0, 0.0, 6.0)


def test_a_zero_variance_band_is_floored_at_min_width() -> None:
    for profiles in ([{"fc1": 2.0}], [{"fc1": 2.0}, {"fc1": 2.0}]):
        band = EntropyBand.calibrate(profiles, min_width=0.2).layers["fc1"]
        assert band.lower == pytest.approx(1.9) and band.upper == pytest.approx(2.1)


def test_calibration_refuses_no_profiles_and_mismatched_layers() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EntropyBand.calibrate([])
    with pytest.raises(ValueError, match="profile 1 has layers"):
        EntropyBand.calibrate([{"fc1": 1.0, "fc2": 2.0}, {"fc1": 1.0}])


BAND = EntropyBand.calibrate(
    [{"fc1": 2.0, "fc2": 5.0}, {"fc1": 3.0, "fc2": 5.5}, {"fc1": 4.0, "fc2": 6.0}]
)  # fc1: [0, 6]; fc2: [4, 7]


def test_training_rows_below_the_band_with_held_out_rows_inside_is_flagged_naming_the_layer() -> None:
    check = BAND.check(training={"fc1": -1.5, "fc2": 5.0}, holdout={"fc1": 1.0, "fc2": 5.0})
    assert check.flagged
    assert check.triggered == {"fc1": pytest.approx(1.5 / 6.0)}
    assert check.drop_bits == pytest.approx(1.5)


def test_both_below_the_band_is_not_memorization() -> None:
    check = BAND.check(training={"fc1": -1.5, "fc2": 3.0}, holdout={"fc1": -1.0, "fc2": 3.9})
    assert not check.flagged
    assert check.triggered == {} and check.drop_bits == 0.0


@pytest.mark.parametrize("training", [{"fc1": 0.0, "fc2": 4.0}, {"fc1": 3.0, "fc2": 9.0}])
def test_training_rows_inside_or_above_the_band_are_not_flagged(training: dict[str, float]) -> None:
    assert not BAND.check(training=training, holdout={"fc1": 3.0, "fc2": 5.0}).flagged


def test_the_largest_drop_over_triggered_layers_is_reported() -> None:
    check = BAND.check(training={"fc1": -0.5, "fc2": 2.0}, holdout={"fc1": 3.0, "fc2": 5.0})
    assert check.triggered == {"fc1": pytest.approx(0.5 / 6.0), "fc2": pytest.approx(2.0 / 3.0)}
    assert check.drop_bits == pytest.approx(2.0)


def test_a_profile_missing_a_calibrated_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"held-out profile lacks calibrated layers \['fc2'\]"):
        BAND.check(training={"fc1": 1.0, "fc2": 5.0}, holdout={"fc1": 1.0})


# --- canary exposure ----------------------------------------------------------------------------


def test_a_tied_reference_counts_one_half_in_the_rank() -> None:
    references = [1.0, 2.0, 2.0, 3.0]
    assert canary_rank(2.0, references) == 3.0  # 1 + one lower + two ties x 1/2
    assert exposure(2.0, references) == pytest.approx(math.log2(5) - math.log2(3), abs=1e-15)


def test_a_memorized_canary_gets_log2_of_references_plus_one() -> None:
    references = torch.linspace(0.0, 10.0, 1000)
    assert exposure(-5.0, references) == math.log2(1001)
    assert exposure(11.0, references) == 0.0  # less likely than every reference


def test_each_rank_once_averages_the_exact_untrained_expectation() -> None:
    references = torch.arange(1000, dtype=torch.float64)
    canaries = references - 0.5  # one canary below each reference...
    canaries = torch.cat([canaries, torch.tensor([999.5], dtype=torch.float64)])  # ...and one above all
    assert sorted(canary_rank(float(c), references) for c in canaries) == [float(r) for r in range(1, 1002)]
    assert mean_exposure(canaries, references) == pytest.approx(expected_untrained_exposure(1000), abs=1e-12)


def test_untrained_canaries_average_about_log2_e_bits() -> None:
    draws, size = 2000, 1000
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(draws, size + 1, generator=generator, dtype=torch.float64)
    mean = sum(exposure(float(row[0]), row[1:]) for row in scores) / draws
    expected = expected_untrained_exposure(size)
    log_ranks = torch.log2(torch.arange(1, size + 2, dtype=torch.float64))
    standard_error = math.sqrt(float(log_ranks.var(correction=0)) / draws)
    assert abs(mean - expected) < 4 * standard_error  # ≈ 0.13 bits
    assert expected == pytest.approx(math.log2(math.e), abs=0.01)


def test_extrapolated_exposure_of_a_canary_at_the_reference_mean_is_one_bit() -> None:
    references = torch.randn(500, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert extrapolated_exposure(float(references.mean()), references) == pytest.approx(1.0, abs=1e-12)


def test_extrapolated_exposure_goes_beyond_the_rank_ceiling() -> None:
    references = torch.randn(500, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    mu, sigma = float(references.mean()), float(references.std())
    far = extrapolated_exposure(mu - 10 * sigma, references)
    assert math.isfinite(far) and far > exposure(mu - 10 * sigma, references) == math.log2(501)
    assert far == pytest.approx(-math.log2(0.5 * math.erfc(10 / math.sqrt(2))), rel=1e-9)


def test_exposure_refuses_degenerate_inputs() -> None:
    with pytest.raises(ValueError, match="reference scores is empty"):
        exposure(1.0, [])
    with pytest.raises(ValueError, match="canary score must be finite"):
        exposure(math.nan, [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        extrapolated_exposure(1.0, [2.0])
    with pytest.raises(ValueError, match="sigma = 0"):
        extrapolated_exposure(1.0, [2.0, 2.0, 2.0])
    with pytest.raises(ValueError, match="canary scores is empty"):
        mean_exposure([], [1.0, 2.0])


def test_mean_exposure_takes_the_extrapolated_measure() -> None:
    references = [-1.0, 1.0]
    assert mean_exposure([0.0, 0.0], references, measure=extrapolated_exposure) == pytest.approx(1.0)


# --- loss gap -----------------------------------------------------------------------------------


def test_loss_gap_is_mean_held_out_minus_mean_training_loss() -> None:
    assert loss_gap([0.1, 0.3], [1.0, 2.0, 3.0]) == pytest.approx(1.8, abs=1e-15)
    assert loss_gap(torch.tensor([2.0, 2.0]), torch.tensor([1.0])) == -1.0


def test_loss_gap_refuses_empty_or_nan_losses() -> None:
    with pytest.raises(ValueError, match="training losses is empty"):
        loss_gap([], [1.0])
    with pytest.raises(ValueError, match="held-out losses is empty"):
        loss_gap([1.0], torch.tensor([]))
    with pytest.raises(ValueError, match="NaN"):
        loss_gap([math.nan], [1.0])


# --- memorization score and report --------------------------------------------------------------

TWO_CORPORA = {
    "news": CorpusMeasures(loss_gap=0.25, exposure_bits=10.0),  # 0.5, 1.25 → 1.25, flagged
    "code": CorpusMeasures(loss_gap=-0.2, exposure_bits=4.0, entropy_drop=0.75),  # 0, 0.5, 0.75 → 0.75
}


def test_memorization_score_is_the_largest_normalized_measure_over_corpora() -> None:
    report = memorization_report(TWO_CORPORA, MemorizationThresholds(entropy_drop=1.0, action="gate"))
    assert report.corpora["news"].normalized == {"loss_gap": 0.5, "exposure_bits": 1.25}
    assert report.corpora["code"].normalized == {"loss_gap": 0.0, "exposure_bits": 0.5, "entropy_drop": 0.75}
    assert (report.corpora["news"].score, report.corpora["code"].score) == (1.25, 0.75)
    assert report.score == 1.25
    assert report.flagged == ["news"]
    assert report.action == "gate"


@pytest.mark.parametrize(
    ("measures", "flagged"),
    [
        (CorpusMeasures(loss_gap=0.5), True),  # exactly at the threshold
        (CorpusMeasures(loss_gap=0.4999, exposure_bits=7.99, entropy_drop=0.999), False),
        (CorpusMeasures(entropy_drop=5.0), False),  # the entropy profile is off by default
        (CorpusMeasures(), False),  # nothing computed
    ],
)
def test_a_corpus_is_flagged_only_when_some_normalized_measure_reaches_one(
    measures: CorpusMeasures, flagged: bool
) -> None:
    report = memorization_report({"c": measures}, MemorizationThresholds())
    assert report.corpora["c"].flagged is flagged
    assert report.flagged == (["c"] if flagged else [])


def test_only_monitored_corpora_count() -> None:
    report = memorization_report(
        TWO_CORPORA, MemorizationThresholds(entropy_drop=1.0, monitored_corpora=["code"])
    )
    assert list(report.corpora) == ["code"]
    assert report.score == 0.75 and report.flagged == []
    assert memorization_report({}, MemorizationThresholds()).score == 0.0


def test_a_monitored_corpus_without_measures_is_refused() -> None:
    with pytest.raises(ValueError, match=r"monitored corpora \['legal'\] have no measures"):
        memorization_report(TWO_CORPORA, MemorizationThresholds(monitored_corpora=["news", "legal"]))


@pytest.mark.parametrize("field", ["loss_gap", "exposure_bits", "entropy_drop"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_thresholds_must_be_positive(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        MemorizationThresholds.model_validate({field: value})


def test_thresholds_refuse_unknown_fields_and_actions() -> None:
    with pytest.raises(ValidationError):
        MemorizationThresholds.model_validate({"gap": 1.0})
    with pytest.raises(ValidationError):
        MemorizationThresholds.model_validate({"action": "delete"})


def test_the_report_round_trips_through_json() -> None:
    report = memorization_report(TWO_CORPORA, MemorizationThresholds(action="rollback"))
    assert MemorizationReport.model_validate_json(report.model_dump_json()) == report


# --- objective ----------------------------------------------------------------------------------


def test_the_penalty_makes_a_memorizer_worse_in_both_directions() -> None:
    assert objective(1.0, score=2.0, lam=0.5, smaller_is_better=True) == 2.0
    assert objective(1.0, score=2.0, lam=0.5, smaller_is_better=False) == 0.0


@pytest.mark.parametrize("smaller_is_better", [True, False])
def test_lambda_zero_leaves_the_metric_unchanged(smaller_is_better: bool) -> None:
    assert objective(0.73, score=5.0, lam=0.0, smaller_is_better=smaller_is_better) == 0.73


def test_a_negative_lambda_is_refused() -> None:
    with pytest.raises(ValueError, match="λ must be ≥ 0"):
        objective(1.0, score=1.0, lam=-0.1, smaller_is_better=True)


# --- end to end ---------------------------------------------------------------------------------


def train_on_random_labels(steps: int) -> float:
    """Fit a small MLP to 20 random-label points (full batch); return its loss gap against 200 more."""
    torch.manual_seed(7)
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(220, 8, generator=generator)
    y = torch.randint(0, 2, (220,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.autograd.backward(torch.nn.functional.cross_entropy(model(x[:20]), y[:20]))
        optimizer.step()
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    return loss_gap(losses[:20], losses[20:])


def test_a_model_that_memorized_random_labels_is_flagged_and_a_briefly_trained_one_is_not() -> None:
    thresholds = MemorizationThresholds()
    memorized = memorization_report(
        {"random": CorpusMeasures(loss_gap=train_on_random_labels(300))}, thresholds
    )
    brief = memorization_report({"random": CorpusMeasures(loss_gap=train_on_random_labels(2))}, thresholds)
    assert memorized.flagged == ["random"]
    assert brief.flagged == [] and brief.score < 0.5
