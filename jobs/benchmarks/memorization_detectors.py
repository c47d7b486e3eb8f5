"""Memorization detectors measured: how well each tells seen rows from unseen rows of the same
corpus (AUROC, TPR at 1% FPR) on both memorization workloads, and whether the policy's default
detectors stay silent on the clean controls.

The workloads are the two memorization benchmarks', trained in this process as they train them
(no Ray), each with its clean control:

- **text** (``memorization_study``): the character transformer whose ``records-lora`` adapter
  trains on fake records with canaries; seen rows = the trained plain records, unseen = the held-out
  tenth (canaries left out). Clean control: the prose-only run (the adapter never trains).
- **digits** (``memorization_digits``): the random-labels memorizer; seen rows = every training
  row, unseen = the held-out rows (ingest's split). Clean control: the same run with true labels.

Every detector of ``govray.governance.detectors`` that the workload's trial allows is scored per
row through the trial's ``predictions`` hook (text under the records adapter, as the probe scores
a corpus on its route); the reference of ``reference_loss`` is the run's initial weights (each
row's loss measured before the first step). At the last step, where both workloads have memorized
(``BENCHMARKS.md``: 9.3 bits of canary exposure; every random label fit from step 1250) each
detector's AUROC (Mann-Whitney U, ties count one half) and TPR at 1% FPR over seen vs unseen rows.
Every ``--every`` steps, each detector's corpus gap (``detectors.detector_gap``, what the probe
reports and the policy thresholds: the probe's samples, as many training rows as held-out ones)
on every run; a point is flagged when a default detector's gap reaches its threshold
(``MemorizationThresholds()``). The last lines are exactly::

    lowest AUROC of the default detectors over both workloads: X.XXX
    flags raised on the clean controls: N

Run: ``python -m jobs.benchmarks.memorization_detectors [--text-steps 1500 --digits-steps 1500]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from govray.governance.detectors import MEMBER_DIRECTION, Detector, detector_gap, example_scores, predicted
from govray.governance.memorization_thresholds import MemorizationThresholds
from jobs.benchmarks.memorization_digits import DATA, DigitsRun, ProbeRows
from jobs.benchmarks.memorization_study import ADAPTER, Study, arguments, study_corpora
from jobs.examples.digits.golden import EXAMPLE_CONFIG, with_random_labels
from jobs.examples.text.trial import encode

Scores = dict[Detector, torch.Tensor]


def auroc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """P(a member scores above a nonmember), ties one half (Mann-Whitney U / (m n)); higher
    scores are evidence of membership."""
    if members.size == 0 or nonmembers.size == 0:
        raise ValueError("AUROC needs members and nonmembers")
    above = members[:, None] > nonmembers[None, :]
    tied = members[:, None] == nonmembers[None, :]
    return float((above.sum() + 0.5 * tied.sum()) / (members.size * nonmembers.size))


def tpr_at_fpr(members: np.ndarray, nonmembers: np.ndarray, fpr: float = 0.01) -> float:
    """The fraction of members above the threshold that at most ``floor(fpr * n)`` of the ``n``
    nonmembers exceed."""
    allowed = int(np.floor(fpr * nonmembers.size))
    threshold = np.sort(nonmembers)[::-1][allowed]
    return float((members > threshold).mean())


# Seen and unseen rows compared at the end: (scores of the seen rows, of the unseen rows) and
# whether the workload memorized them (only those comparisons choose the defaults).
COMPARISONS = {
    "records rows": ("seen", "unseen", False),  # plain records: BENCHMARKS.md, issue 35
    "canaries vs never-trained candidates": ("canaries", "candidates", True),
    "rows": ("seen", "unseen", True),
}


@dataclass
class Measured:
    """One run's scores at the end (seen and unseen, by comparison), the gaps at each measurement."""

    pairs: dict[str, tuple[Scores, Scores]]
    memorized: dict[str, bool]
    gaps: dict[int, dict[Detector, float]]


def gaps_of(sample: Scores, unseen: Scores) -> dict[Detector, float]:
    return {name: detector_gap(name, sample[name], unseen[name]) for name in sample}


class TextWorkload:
    """A ``memorization_study`` run, scored on its records corpus with the adapter active: the
    plain records (trained and held out), and the canaries against the never-trained candidates
    of their template that exposure ranks them among."""

    comparisons = ("records rows", "canaries vs never-trained candidates")

    def __init__(self, study: Study) -> None:
        self.study = study
        self.seen = study.records_probe
        self.unseen = study.records_holdout
        self.sample = self.seen[: len(self.unseen)]  # the probe's: as many training rows as held out
        width = study.args.row_chars
        self.canaries = [canary.text.ljust(width, "\n") for canary in study.canaries.canaries]
        self.candidates = [text.ljust(width, "\n") for text in study.references]
        self.reference = {name: self.losses(texts) for name, texts in self.rows().items()}

    def rows(self) -> dict[str, list[str]]:
        return {
            "seen": self.seen,
            "unseen": self.unseen,
            "sample": self.sample,
            "canaries": self.canaries,
            "candidates": self.candidates,
        }

    @torch.no_grad()
    def losses(self, texts: Sequence[str]) -> torch.Tensor:
        return self.scores(texts, None)["loss"]

    @torch.no_grad()
    def scores(self, texts: Sequence[str], reference: torch.Tensor | None) -> Scores:
        study = self.study
        study.model.eval()
        batch = {"text": encode(texts, study.args.row_chars)}
        with study.model.active(ADAPTER):
            losses = study.trial.loss(study.model, batch)
            predictions = study.trial.predictions(study.model, batch)
        logits, targets, mask = predicted(predictions)
        return example_scores(losses, logits, targets, mask, reference, texts)

    def measure(self) -> dict[str, Scores]:
        return {name: self.scores(texts, self.reference[name]) for name, texts in self.rows().items()}


class DigitsWorkload:
    """A ``memorization_digits`` run, scored on its corpus."""

    comparisons = ("rows",)

    def __init__(self, run: DigitsRun) -> None:
        self.run = run
        rows = run.rows
        self.index = {"seen": rows.train, "unseen": rows.holdout, "sample": rows.gap_train}
        self.reference = {name: self.scores(index, None)["loss"] for name, index in self.index.items()}

    @torch.no_grad()
    def scores(self, rows: np.ndarray, reference: torch.Tensor | None) -> Scores:
        run = self.run
        run.model.eval()
        batch = run.rows_batch(rows)
        losses = run.trial.loss(run.model, batch)
        logits, targets, mask = predicted(run.trial.predictions(run.model, batch))
        return example_scores(losses, logits, targets, mask, reference)

    def measure(self) -> dict[str, Scores]:
        return {name: self.scores(index, self.reference[name]) for name, index in self.index.items()}


def trained(
    workload: TextWorkload | DigitsWorkload, step: Callable[[], None], steps: int, every: int
) -> Measured:
    gaps: dict[int, dict[Detector, float]] = {}
    for index in range(steps):
        step()
        if (index + 1) % every == 0:
            scores = workload.measure()
            gaps[index + 1] = gaps_of(scores["sample"], scores["unseen"])
    scores = workload.measure()
    pairs = {}
    for label in workload.comparisons:
        seen, unseen, _ = COMPARISONS[label]
        pairs[label] = (scores[seen], scores[unseen])
    memorized = {label: COMPARISONS[label][2] for label in workload.comparisons}
    return Measured(pairs=pairs, memorized=memorized, gaps=gaps)


def default_detectors(thresholds: MemorizationThresholds) -> dict[Detector, float]:
    """The detectors the default policy flags on, with their thresholds (the loss gap's is ``loss``)."""
    limits = thresholds.detector_limits()
    return {name: limit for name, limit in limits.items() if limit is not None}


def raised(measured: Measured, defaults: dict[Detector, float]) -> dict[int, list[Detector]]:
    """Step → the detectors whose corpus gap reached its threshold there."""
    return {
        step: sorted(name for name, limit in defaults.items() if gaps[name] >= limit)
        for step, gaps in measured.gaps.items()
    }


def text_run(with_records: bool, steps: int, every: int) -> Measured:
    """``memorization_study``'s run with records (the memorizer) or prose only (its clean control)."""
    options = arguments().parse_args([])
    study = Study(with_records, study_corpora(options), options)
    return trained(TextWorkload(study), study.step, steps, every)


def digits_run(random_labels: bool, steps: int, every: int) -> Measured:
    """``memorization_digits``'s random-labels memorizer or its true-labels clean control."""
    example = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    table = pq.read_table(DATA)
    rows = ProbeRows.split(table, float(example["data"]["holdout_fraction"]))
    labelled = with_random_labels(table) if random_labels else table
    name = "random labels" if random_labels else "true labels"
    run = DigitsRun(name, labelled, rows, int(example["seed"]))
    return trained(DigitsWorkload(run), run.step, steps, every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-steps", type=int, default=1500)
    parser.add_argument("--digits-steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small models: a second thread mostly waits for the first on 2 shared cores
    started = time.perf_counter()
    runs: dict[tuple[str, bool], Measured] = {}  # (workload, memorizing) → measured
    for memorizing in (True, False):
        runs["text", memorizing] = text_run(memorizing, args.text_steps, args.every)
    for memorizing in (True, False):
        runs["digits", memorizing] = digits_run(memorizing, args.digits_steps, args.every)
    print(f"({time.perf_counter() - started:.0f} s)")

    defaults = default_detectors(MemorizationThresholds())
    lowest = 1.0
    print("detector AUROC and TPR at 1% FPR, seen vs unseen at the last step (memorizing runs):")
    for (workload, memorizing), measured in runs.items():
        if not memorizing:
            continue
        for label, (seen, unseen) in measured.pairs.items():
            counted = measured.memorized[label]
            note = "" if counted else "; not memorized, not counted"
            for name in seen:
                sign = MEMBER_DIRECTION[name]
                members, nonmembers = sign * seen[name].numpy(), sign * unseen[name].numpy()
                area = auroc(members, nonmembers)
                if name in defaults and counted:
                    lowest = min(lowest, area)
                mark = " (default)" if name in defaults else ""
                tpr = tpr_at_fpr(members, nonmembers)
                print(
                    f"  {workload} {label}, {name}{mark}: AUROC {area:.3f}, TPR at 1% FPR {tpr:.3f} "
                    f"({members.size} seen, {nonmembers.size} unseen{note})"
                )
    flags = 0
    print(f"corpus gaps (training sample vs held-out rows) and default thresholds {defaults}:")
    for (workload, memorizing), measured in runs.items():
        label = f"{workload} {'memorizer' if memorizing else 'clean control'}"
        for step, names in raised(measured, defaults).items():
            if not memorizing:
                flags += len(names)
            values = ", ".join(f"{name} {value:.3f}" for name, value in measured.gaps[step].items())
            print(f"  {label} step {step}: {values}; flagged by {names or '-'}")
    print(f"lowest AUROC of the default detectors over both workloads: {lowest:.3f}")
    print(f"flags raised on the clean controls: {flags}")


if __name__ == "__main__":
    main()
