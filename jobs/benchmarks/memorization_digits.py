"""Memorization on the digits workload: the loss gap and the entropy profile over training, on the
random-labels memorizer and on the same model with true labels.

The digits trial (``jobs/examples/digits``) with the memorizer's hyperparameters
(``golden.MEMORIZER``: hidden 256, no dropout, AdamW lr 0.003, batch 32) trains in this process, no
Ray, on the public corpus only (``data/public.parquet``, 900 rows). The corpus is split as ingest
splits it (row hash against the example's ``holdout_fraction``; the hashes of the committed rows,
so both runs hold out the same images), and measured as ``govray/train/control/probe.py`` measures a
corpus, with its constants:

- **loss gap** (Yeom et al. 2018, ``memorization.loss_gap``): mean loss of the held-out rows (the
  ``PROBE_HOLDOUT_ROWS`` with the lowest row hashes) - mean loss of as many training rows (lowest
  row hashes, at most ``LOSS_GAP_SAMPLE``);
- **entropy profile** (``memorization.entropy_profile`` of ``probe.layer_representations``: each
  layer's output, embed, hidden and head): a band calibrated on ``CALIBRATION_BATCHES`` held-out
  batches of ``min(PROBE_ROWS, held-out rows / 5)`` rows, one more held-out batch and one training
  batch checked against it (``EntropyBand.check``).

Both are scored by ``memorization_report`` under the thresholds of ``policies/digits.policy.yaml``
(the defaults where it sets none: loss gap 0.5 nats; the entropy drop at 1 bit, its default
until issue 35 turned the profile off), so a measure's flag is
the one the platform would raise. Two runs with the same seed, initialization and batch order:
**random labels** (``golden.with_random_labels``: the corpus's labels shuffled, as the golden
rollback run and the memorization tests train it; held-out rows get shuffled labels too) and
**true labels** (the clean control). Every ``--every`` steps one line per run; the agreement is the
fraction of (measurement, run) points where the entropy-profile flag equals the loss-gap flag. The
last lines are exactly::

    band-exit agreement with the loss gap (random labels): X.XX
    entropy-profile agreement with the loss gap (random labels): X.XX

The first counts a point flagged when some layer's training-row entropy falls below the band at
all (``EntropyCheck.flagged``, what ``memorization_study.py`` counts on the text workload); the
second when the drop reaches the policy's ``entropy_drop`` (the flag the platform raises). Each
line also gives every layer's entropy on the loss gap's two samples (training / held-out rows, 5x
the probe's batch), to tell a spectrum that does not differ from a band too wide to see it.

Run: ``python -m jobs.benchmarks.memorization_digits [--steps 3000 --every 250]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from govray.data.rowhash import holdout_mask, row_hashes
from govray.governance.memorization import (
    CorpusMeasures,
    EntropyBand,
    MemorizationThresholds,
    entropy_profile,
    loss_gap,
    memorization_report,
)
from govray.governance.policy import DepthPolicy
from govray.train.control.probe import (
    CALIBRATION_BATCHES,
    LOSS_GAP_SAMPLE,
    MIN_PROBE_ROWS,
    PROBE_HOLDOUT_ROWS,
    PROBE_ROWS,
    layer_representations,
)
from jobs.examples.digits.golden import EXAMPLE_CONFIG, MEMORIZER, REPO, with_random_labels
from jobs.examples.digits.trial import DigitsTrial

CORPUS = "digits-public"
DATA = REPO / "jobs" / "examples" / "digits" / "data" / "public.parquet"
POLICY = REPO / "policies" / "digits.policy.yaml"


@dataclass(frozen=True)
class ProbeRows:
    """Row numbers of the corpus: what trains, and what each measure reads (fixed for both runs)."""

    train: np.ndarray  # every training row
    gap_train: np.ndarray  # the loss gap's training sample
    holdout: np.ndarray  # the held-out rows measured
    calibration: list[np.ndarray]  # held-out batches the band is calibrated on
    check: np.ndarray  # one more held-out batch, checked against the band
    profile_train: np.ndarray  # the training batch checked against the band

    @classmethod
    def split(cls, table: pa.Table, holdout_fraction: float) -> ProbeRows:
        """Ingest's split of ``table`` and the probe's samples of it: lowest row hashes first."""
        hashes, prefixes = row_hashes(table)
        held = holdout_mask(prefixes, holdout_fraction)
        by_hash = np.argsort(hashes.to_numpy(zero_copy_only=False), kind="stable")
        train, holdout = by_hash[~held[by_hash]], by_hash[held[by_hash]][:PROBE_HOLDOUT_ROWS]
        size = min(PROBE_ROWS, len(holdout) // (CALIBRATION_BATCHES + 1))
        if size < MIN_PROBE_ROWS:
            raise ValueError(f"{len(holdout)} held-out rows give no entropy profile (batches of {size})")
        batches = [holdout[index * size : (index + 1) * size] for index in range(CALIBRATION_BATCHES + 1)]
        return cls(
            train=np.sort(train),
            gap_train=train[: min(len(holdout), LOSS_GAP_SAMPLE)],
            holdout=holdout,
            calibration=batches[:CALIBRATION_BATCHES],
            check=batches[CALIBRATION_BATCHES],
            profile_train=train[:size],
        )


@dataclass(frozen=True)
class Point:
    """One measurement of one run."""

    run: str
    step: int
    train_accuracy: float  # on the loss gap's training sample
    gap: float
    gap_flag: bool
    drop_bits: float
    band_exit: bool  # some layer's training-row entropy below the band (EntropyCheck.flagged)
    entropy_flag: bool  # the drop reached the policy's entropy_drop
    triggered: list[str]
    # layer → spectral entropy (bits) on the loss gap's training sample and on its held-out rows:
    # whether the spectrum of seen rows differs from unseen ones on batches 5x the probe's
    sample_entropy: dict[str, tuple[float, float]]

    def line(self) -> str:
        layers = ",".join(self.triggered) or "-"
        samples = ", ".join(
            f"{layer} {seen:.2f}/{unseen:.2f}" for layer, (seen, unseen) in self.sample_entropy.items()
        )
        return (
            f"{self.run} step {self.step}: train accuracy {self.train_accuracy:.2f}, "
            f"loss gap {self.gap:.2f} (flag {self.gap_flag}), entropy drop {self.drop_bits:.2f} bits "
            f"below band in [{layers}] (band exit {self.band_exit}, flag {self.entropy_flag}); "
            f"entropy on the loss gap's rows, training/held-out: {samples}"
        )


class DigitsRun:
    """One in-process training run on the corpus ``table`` and its measurements."""

    def __init__(self, name: str, table: pa.Table, rows: ProbeRows, seed: int) -> None:
        self.name = name
        self.rows = rows
        self.trial = DigitsTrial(MEMORIZER)
        torch.manual_seed(seed)
        self.model = self.trial.build_model()
        self.layers = list(self.trial.layers(self.model) or [])
        self.optimizer = self.trial.build_optimizer(self.model.parameters())
        self.batch = self.trial.collate(table)  # 900 rows: every tensor in memory
        self.order = np.random.default_rng(seed)  # the same batch order in every run
        self.queue: list[int] = []

    def rows_batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(rows, dtype=torch.long)
        return {key: tensor[index] for key, tensor in self.batch.items()}

    def step(self) -> None:
        """One optimizer step on the next ``batch_size`` training rows (epochs in shuffled order)."""
        if len(self.queue) < self.trial.batch_size:
            self.queue += self.order.permutation(self.rows.train).tolist()
        rows, self.queue = self.queue[: self.trial.batch_size], self.queue[self.trial.batch_size :]
        self.model.train()
        loss = self.trial.loss(self.model, self.rows_batch(np.asarray(rows))).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def profile(self, rows: np.ndarray) -> dict[str, float]:
        batch = self.rows_batch(rows)
        return entropy_profile(
            layer_representations(
                self.trial, self.model, self.layers, lambda: self.trial.loss(self.model, batch)
            )
        )

    @torch.no_grad()
    def measure(self, step: int, thresholds: MemorizationThresholds) -> Point:
        self.model.eval()
        train = self.trial.evaluate(self.model, self.rows_batch(self.rows.gap_train))
        holdout = self.trial.loss(self.model, self.rows_batch(self.rows.holdout))
        band = EntropyBand.calibrate([self.profile(rows) for rows in self.rows.calibration])
        check = band.check(
            training=self.profile(self.rows.profile_train), holdout=self.profile(self.rows.check)
        )
        gap = loss_gap(train["loss"], holdout)
        measures = CorpusMeasures(loss_gap=gap, entropy_drop=check.drop_bits)
        normalized = memorization_report({CORPUS: measures}, thresholds).corpora[CORPUS].normalized
        seen, unseen = self.profile(self.rows.gap_train), self.profile(self.rows.holdout)
        return Point(
            run=self.name,
            step=step,
            train_accuracy=float(train["accuracy"].mean()),
            gap=gap,
            gap_flag=normalized["loss_gap"] >= 1.0,
            drop_bits=check.drop_bits,
            band_exit=check.flagged,
            entropy_flag=normalized["entropy_drop"] >= 1.0,
            triggered=sorted(check.triggered),
            sample_entropy={layer: (seen[layer], unseen[layer]) for layer in self.layers},
        )


def policy_thresholds() -> MemorizationThresholds:
    """The digits policy's memorization thresholds, or the defaults the training loop uses; the
    entropy drop at 1 bit where they leave the profile off (its default until issue 35), so its
    flag can be compared."""
    policy = DepthPolicy.model_validate(yaml.safe_load(POLICY.read_text()))
    thresholds = policy.memorization or MemorizationThresholds()
    if thresholds.entropy_drop is None:
        thresholds = thresholds.model_copy(update={"entropy_drop": 1.0})
    if thresholds.loss_gap is None:
        raise ValueError(f"{POLICY} sets loss_gap: null; there is no loss-gap flag to compare with")
    return thresholds


def agreement(points: list[Point], flag: Callable[[Point], bool]) -> float:
    """The fraction of points where ``flag`` equals the loss-gap flag."""
    return sum(flag(point) == point.gap_flag for point in points) / len(points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250)
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    example = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    seed = int(example["seed"])
    table = pq.read_table(DATA)
    rows = ProbeRows.split(table, float(example["data"]["holdout_fraction"]))
    thresholds = policy_thresholds()
    print(
        f"{len(rows.train)} training rows, {len(rows.holdout)} held out; loss gap on {len(rows.gap_train)} "
        f"vs {len(rows.holdout)} rows, profile batches of {len(rows.check)}; thresholds: loss gap "
        f"{thresholds.loss_gap}, entropy drop {thresholds.entropy_drop} bits"
    )
    points: list[Point] = []
    for name, labelled in (("random labels", with_random_labels(table)), ("true labels", table)):
        run = DigitsRun(name, labelled, rows, seed)
        for index in range(args.steps):
            run.step()
            if (index + 1) % args.every == 0:
                points.append(run.measure(index + 1, thresholds))
                print(points[-1].line())
    print(f"({time.perf_counter() - started:.0f} s)")
    band_exit = agreement(points, lambda point: point.band_exit)
    flagged = agreement(points, lambda point: point.entropy_flag)
    print(f"band-exit agreement with the loss gap (random labels): {band_exit:.2f}")
    print(f"entropy-profile agreement with the loss gap (random labels): {flagged:.2f}")


if __name__ == "__main__":
    main()
