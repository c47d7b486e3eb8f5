"""Memorization on the text workload: canary exposure and the entropy profile over training, with
and without the canary corpus, and what removing the corpus's adapter leaves.

The character-level transformer (``jobs/examples/text``) trains in this process, no Ray, on the
small variant of the text corpora (``make_corpora.small_corpora``: the committed prose re-cut into
``--row-chars`` rows; fresh fake records with ``--canaries`` canaries, ``--repeats`` copies each,
sensitivity pii). The records are routed to the ``records-lora`` adapter as
``policies/text.policy.yaml`` routes them, with one change made here: the adapter also wraps the
output projection ``head.proj`` (the committed policy adapts only ``attn.qkv`` and ``mlp.fc``;
without the head, the adapter cannot raise a digit's logit that the prose-trained head keeps low,
and memorizes too slowly to measure: 2.8 bits after 1,200 steps on the full corpora). Prose
batches update the base only, records batches the adapter only; ``--records-fraction`` of the
batches are records. Every ``--every`` steps:

- **exposure** (Carlini et al. 2019, rank definition, ``govray.governance.memorization.exposure``): each
  canary's NLL with the adapter active, ranked among ``--refs`` never-trained candidates from the
  same template; the mean over canaries; flagged at ``--exposure-flag`` bits (chance, an untrained
  canary, is about log2(e) = 1.44);
- **entropy profile** (``govray.governance.memorization``, the estimator the training loop uses): the
  spectral entropy (bits) of each layer's representation (``Trial.representation``: the output
  averaged over positions) on records' training rows vs held-out records rows, against a band
  calibrated on 4 held-out batches, canary rows left out (as ``govray/train/control/probe.py`` does);
  flagged when training rows fall below the band on some layer while held-out rows do not.

Two runs: with the records corpus, and without it (prose only; the adapter stays untrained). The
agreement is the fraction of (measurement, run) points where the entropy-profile flag equals the
exposure flag. At the end the adapter of the run with records is removed and exposure measured on
the bare base. The last lines are exactly::

    exposure with adapter: X.XX bits
    exposure after removal: X.XX bits
    entropy-profile agreement with exposure: X.XX

Run: ``python -m jobs.benchmarks.memorization_study [--steps 1500 --every 250]``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml

from govray.governance.adapters import GovernedModel
from govray.governance.canaries import CanarySet
from govray.governance.memorization import EntropyBand, entropy_profile, mean_exposure
from govray.governance.policy import DepthPolicy
from govray.governance.routing import resolve_routes
from govray.train.control.probe import layer_representations
from jobs.examples.text.make_corpora import small_corpora
from jobs.examples.text.trial import CharTransformerTrial, encode

REPO = Path(__file__).resolve().parents[2]
ADAPTER = "records-lora"
ADAPTER_TARGETS = ["blocks.*.attn.qkv", "blocks.*.mlp.fc", "head.proj"]
BATCH = 32
CALIBRATION_BATCHES = 4


def study_policy() -> DepthPolicy:
    """The text example's policy with ``head.proj`` added to the records adapter (see above)."""
    raw = yaml.safe_load((REPO / "policies" / "text.policy.yaml").read_text())
    raw["adapters"][ADAPTER]["targets"] = ADAPTER_TARGETS
    return DepthPolicy.model_validate(raw)


class Study:
    """One training run and its measurements."""

    def __init__(self, with_records: bool, data: Path, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.args = args
        self.trial = CharTransformerTrial(
            {"d_model": 64, "n_layers": 2, "n_heads": 4, "context": args.row_chars}
        )
        base = self.trial.build_model()
        policy = study_policy()
        self.model = GovernedModel(
            base, resolve_routes(policy, base, self.trial.layers(base)), policy.adapters, seed=1
        )
        self.layers = self.trial.layers(base)
        self.with_records = with_records
        self.prose = pq.read_table(data / "public.parquet").column("text").to_pylist()
        records = [json.loads(line)["text"] for line in (data / "records.jsonl").read_text().splitlines()]
        self.canaries = CanarySet.load(data / "canaries.json")
        canary_rows = {row for canary in self.canaries.canaries for row in canary.rows}
        plain = [index for index in range(len(records)) if index not in canary_rows]
        held = set(plain[::10])  # every tenth plain record is held out (never trained)
        self.records_train = [text for index, text in enumerate(records) if index not in held]
        self.records_probe = [records[index] for index in plain if index not in held]
        self.records_holdout = [records[index] for index in sorted(held)]
        self.references = self.canaries.candidates(args.refs, random.Random(0))
        self.base_optimizer = torch.optim.AdamW(
            [parameter for _, parameter in self.model.base_named_parameters()], lr=args.lr
        )
        self.adapter_optimizer = torch.optim.AdamW(self.model.adapter_parameters(ADAPTER), lr=args.adapter_lr)
        self.rng = random.Random(0)

    def step(self) -> None:
        records_turn = self.with_records and self.rng.random() < self.args.records_fraction
        texts = self.rng.sample(self.records_train if records_turn else self.prose, BATCH)
        optimizer = self.adapter_optimizer if records_turn else self.base_optimizer
        self.model.train()
        with self.model.active(ADAPTER if records_turn else None):
            loss = self.trial.loss(self.model, {"text": encode(texts, self.args.row_chars)}).mean()
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def exposure(self, adapter: str | None) -> float:
        with self.model.active(adapter):
            canaries = self.trial.sequence_scores(self.model, [c.text for c in self.canaries.canaries])
            references = self.trial.sequence_scores(self.model, self.references)
        return mean_exposure(canaries.tolist(), references)

    @torch.no_grad()
    def profile(self, texts: list[str]) -> dict[str, float]:
        """Spectral entropy of each layer's representation on ``texts`` (adapter active)."""

        def forward() -> None:
            with self.model.active(ADAPTER):
                self.trial.loss(self.model, {"text": encode(texts, self.args.row_chars)})

        self.model.eval()
        return entropy_profile(layer_representations(self.trial, self.model.base, self.layers, forward))

    def entropy_flag(self) -> bool:
        size = self.args.probe
        holdout = self.records_holdout
        calibration = [self.profile(holdout[i * size : (i + 1) * size]) for i in range(CALIBRATION_BATCHES)]
        check = holdout[CALIBRATION_BATCHES * size : (CALIBRATION_BATCHES + 1) * size]
        band = EntropyBand.calibrate(calibration)
        return band.check(self.profile(self.records_probe[:size]), self.profile(check)).flagged


def arguments() -> argparse.ArgumentParser:
    """The study's options (``memorization_detectors`` trains the same runs with their defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--refs", type=int, default=1000)
    parser.add_argument("--probe", type=int, default=12)
    parser.add_argument("--exposure-flag", type=float, default=4.0)
    parser.add_argument("--row-chars", type=int, default=48)
    parser.add_argument("--canaries", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--records-fraction", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--adapter-lr", type=float, default=0.01)
    return parser


def study_corpora(args: argparse.Namespace) -> Path:
    """The small text corpora with the study's canaries, written to a fresh temporary directory."""
    data = Path(tempfile.mkdtemp(prefix="govray-memorization-study-"))
    small_corpora(
        data,
        row_chars=args.row_chars,
        prose_rows=1500,
        record_count=600,
        canary_count=args.canaries,
        repeats=args.repeats,
    )
    return data


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    data = study_corpora(args)
    agreements: list[bool] = []
    final: Study | None = None
    for with_records in (True, False):
        study = Study(with_records, data, args)
        label = "with records" if with_records else "prose only"
        for index in range(args.steps):
            study.step()
            if (index + 1) % args.every == 0:
                exposure = study.exposure(ADAPTER)
                flag = study.entropy_flag()
                agreements.append(flag == (exposure >= args.exposure_flag))
                print(f"{label} step {index + 1}: exposure {exposure:.2f} bits, entropy-profile flag {flag}")
        if with_records:
            final = study
    assert final is not None
    with_adapter = final.exposure(ADAPTER)
    final.model.drop_adapter(ADAPTER)
    after_removal = final.exposure(None)
    print(f"({time.perf_counter() - started:.0f} s; data in {data})")
    print(f"exposure with adapter: {with_adapter:.2f} bits")
    print(f"exposure after removal: {after_removal:.2f} bits")
    print(f"entropy-profile agreement with exposure: {sum(agreements) / len(agreements):.2f}")


if __name__ == "__main__":
    main()
