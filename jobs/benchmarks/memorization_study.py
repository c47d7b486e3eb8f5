"""Memorization on the text workload: canary exposure and the entropy profile over training, with
and without the canary corpus, and what removing the corpus's adapter leaves.

The character-level transformer (``jobs/examples/text``) trains in this process, no Ray: prose
(``text-public``) updates the base; the records corpus with its 10 canaries (``text-records``,
sensitivity pii) is routed by ``policies/text.policy.yaml`` to the ``records-lora`` adapter, so its
batches update only the adapter (the adapter is active only on its own batches). Every
``--every`` steps:

- **exposure** (Carlini et al. 2019, rank definition): each canary's NLL ranked among ``--refs``
  never-trained candidates from the same template; mean over canaries; flagged at
  ``--exposure-flag`` bits (chance is about log2(e) = 1.44);
- **entropy profile**: the spectral entropy (bits) of each block's output on records' training
  rows vs held-out records rows, against a band calibrated on held-out batches; flagged when
  training rows fall below the band on some layer while held-out rows do not.

Two runs: with the records corpus, and without it (prose only). The agreement is the fraction of
(checkpoint, run) points where the entropy-profile flag equals the exposure flag. The last lines
are exactly::

    exposure with adapter: X.XX bits
    exposure after removal: X.XX bits
    entropy-profile agreement with exposure: X.XX

Run: ``python -m jobs.benchmarks.memorization_study [--steps 1200 --every 200]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import torch

from govray.adapters import GovernedModel
from govray.memorization import EntropyBand, entropy_profile, mean_exposure
from govray.policy import load_policy
from govray.routing import resolve_routes
from jobs.examples.text.canaries import CanarySet
from jobs.examples.text.trial import CharTransformer, CharTransformerTrial, encode

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "jobs" / "examples" / "text" / "data"
ADAPTER = "records-lora"
HPARAMS = {"d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.0, "lr": 3e-3, "batch_size": 32}
BATCH = 32
ADAPTER_LR = 1e-2  # LoRA learns slower than the base: a larger step


class Study:
    """One training run and its measurements."""

    def __init__(self, with_records: bool, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.trial = CharTransformerTrial(HPARAMS)
        base = self.trial.build_model()
        policy = load_policy(REPO / "policies" / "text.policy.yaml")
        table = resolve_routes(policy, base, self.trial.layers(base))
        self.model = GovernedModel(base, table, policy.adapters, seed=1)
        self.with_records = with_records
        self.args = args
        self.prose = pq.read_table(DATA / "public.parquet").column("text").to_pylist()
        records = [json.loads(line)["text"] for line in (DATA / "records.jsonl").read_text().splitlines()]
        self.canaries = CanarySet.load(DATA / "canaries.json")
        canary_rows = {row for canary in self.canaries.canaries for row in canary.rows}
        plain = [index for index in range(len(records)) if index not in canary_rows]
        held = set(plain[::10])  # every tenth plain record is held out (never trained)
        self.records_train = [text for index, text in enumerate(records) if index not in held]
        self.records_holdout = [records[index] for index in sorted(held)]
        self.references = self.canaries.candidates(args.refs, random.Random(0))
        self.base_optimizer = torch.optim.AdamW(self.model.base.parameters(), lr=HPARAMS["lr"])
        self.adapter_optimizer = torch.optim.AdamW(self.model.adapter_parameters(ADAPTER), lr=ADAPTER_LR)
        self.rng = random.Random(0)

    def step(self, index: int) -> None:
        records_turn = self.with_records and index % 2 == 1
        texts = self.rng.sample(self.records_train if records_turn else self.prose, BATCH)
        optimizer = self.adapter_optimizer if records_turn else self.base_optimizer
        self.model.train()
        with self.model.active(ADAPTER if records_turn else None):
            loss = self.trial.loss(self.model, {"text": encode(texts, self.trial.context)}).mean()
        optimizer.zero_grad(set_to_none=True)
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
        """Spectral entropy of each block's output (mean over positions) on ``texts``."""
        outputs: dict[str, torch.Tensor] = {}
        assert isinstance(self.model.base, CharTransformer)
        hooks = [
            block.register_forward_hook(
                lambda _m, _i, out, name=f"blocks.{i}": outputs.__setitem__(name, out)
            )
            for i, block in enumerate(self.model.base.blocks)
        ]
        self.model.eval()
        try:
            with self.model.active(ADAPTER):
                self.model(encode(texts, self.trial.context))
        finally:
            for hook in hooks:
                hook.remove()
        return entropy_profile({name: value.mean(dim=1) for name, value in outputs.items()})

    def entropy_flag(self) -> bool:
        """Records' training rows vs held-out rows (canaries left out: mostly padding, they would
        collapse the representation by their shape, not by memorization)."""
        size = self.args.probe
        holdout = self.records_holdout
        band = EntropyBand.calibrate([self.profile(holdout[i : i + size]) for i in range(0, 4 * size, size)])
        canaries = {c.text for c in self.canaries.canaries}
        training = [text for text in self.records_train if text.rstrip("\n") not in canaries][:size]
        return band.check(self.profile(training), self.profile(holdout[4 * size : 5 * size])).flagged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--refs", type=int, default=200)
    parser.add_argument("--probe", type=int, default=32)
    parser.add_argument("--exposure-flag", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    agreements: list[bool] = []
    final: Study | None = None
    for with_records in (True, False):
        study = Study(with_records, args)
        for index in range(args.steps):
            study.step(index)
            if (index + 1) % args.every == 0:
                exposure = study.exposure(ADAPTER)
                flag = study.entropy_flag()
                agreements.append(flag == (exposure >= args.exposure_flag))
                label = "with records" if with_records else "prose only"
                print(f"{label} step {index + 1}: exposure {exposure:.2f} bits, entropy-profile flag {flag}")
        if with_records:
            final = study
    assert final is not None
    with_adapter = final.exposure(ADAPTER)
    final.model.drop_adapter(ADAPTER)
    after_removal = final.exposure(None)
    print(f"exposure with adapter: {with_adapter:.2f} bits")
    print(f"exposure after removal: {after_removal:.2f} bits")
    print(f"entropy-profile agreement with exposure: {sum(agreements) / len(agreements):.2f}")


if __name__ == "__main__":
    main()
