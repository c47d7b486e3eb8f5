"""The memorization measures the training loop takes at every validation (scored by
:mod:`govray.governance.memorization`; README, "Hyperparameter search", **Memorization**).

For each training corpus with held-out rows, every forward pass runs through the corpus's own route
(its adapter active, where memorized PII would live); a held-out row's route is what the policy
gives its credential, since ingest routes held-out rows nowhere. The rows are fixed for the run and
bounded whatever the corpus's size: the ``PROBE_HOLDOUT_ROWS`` held-out rows with the lowest row
hashes (found in one pass over the hash column, a row group at a time), and as many training rows:

- **loss gap** (Yeom et al. 2018): mean held-out loss - mean training loss, over a fixed sample of
  training rows (lowest row hashes, as many as the held-out rows, at most ``LOSS_GAP_SAMPLE``);
- **detector gaps** (``governance.detectors``), on the same rows: each per-example detector's mean
  over the training sample against its mean over the held-out rows, signed so that > 0 is
  memorization: the reference-calibrated loss (the reference = the run's initial weights: each
  row's loss is taken once, when the probe is built, before any step or restore), and, for a trial
  that gives its logits (``Trial.predictions``), Min-K% Prob, Min-K%++, the confidence and, for
  rows with a ``text`` column, the zlib ratio;
- **entropy profile**: the spectral entropy (``memorization.spectral_entropy``: Shannon entropy of
  the normalized singular-value spectrum) of every layer's representation
  (``Trial.representation``) on probe batches of up to ``PROBE_ROWS`` rows — a band calibrated on
  ``CALIBRATION_BATCHES`` held-out batches, then one more held-out batch and one training batch
  checked against it (``EntropyBand.check``); a corpus with fewer than
  ``(CALIBRATION_BATCHES + 1) * MIN_PROBE_ROWS`` held-out rows gets no profile;
- **canary exposure** (Carlini et al. 2019), for a corpus that declares canaries: each trained
  canary's score (``Trial.sequence_scores``) ranked among the configured number of never-trained
  candidates from the same template (rank definition), averaged over the corpus's trained
  canaries (those with at least one copy among the training rows).

Canary rows are left out of the loss gap and the profile: their copies fall on both sides of the
holdout split, so "held-out" copies were trained too, and a repeated short text collapses a
representation by its shape rather than by memorization.

Work is split over ranks (rows for losses, whole batches for profiles, texts for scores) and
summed in one all-gather, so every rank ends with the same measures. Every forward pass runs under
the training step's autocast (bf16/fp16 runs are measured as they train, at their speed).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from govray.data.schedule import derive_seed
from govray.data.shards import ShardManifest
from govray.governance.adapters import GovernedModel
from govray.governance.canaries import CanaryProbe
from govray.governance.credentials import Credential
from govray.governance.detectors import Detector, example_scores, gap_of_means, predicted
from govray.governance.memorization import CorpusMeasures, EntropyBand, entropy_profile, exposure
from govray.governance.memorization_thresholds import DETECTOR_THRESHOLDS
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable
from govray.train.parallel.worker import RouteRows, Worker, all_reduce_sums
from govray.train.step.batches import on_device, row_batches
from govray.train.trial import ProbeHooks, Trial

LOSS_GAP_SAMPLE = 512  # training rows per corpus the loss gap compares with its held-out rows
PROBE_HOLDOUT_ROWS = 1024  # held-out rows per corpus the probe measures (lowest row hashes)
PROBE_ROWS = 32  # rows per entropy-profile batch
MIN_PROBE_ROWS = 8  # smaller batches give no profile
CALIBRATION_BATCHES = 4  # held-out batches the band is calibrated on
_CHECK, _TRAINING = "check", "training"


@dataclass
class _CorpusPlan:
    """The fixed rows and texts one corpus is measured on (chosen once; the model changes)."""

    corpus_id: str
    train_sample: pa.Table
    holdout: pa.Table
    entropy_batches: dict[str, pa.Table] = field(default_factory=dict)  # calibration-i, check, training
    canary_texts: dict[str, list[str]] = field(default_factory=dict)  # route → trained canaries' texts
    references: list[str] = field(default_factory=list)
    # train/holdout → this worker's rows' losses under the initial weights (reference_loss)
    initial_losses: dict[str, torch.Tensor | None] = field(default_factory=dict)


class MemorizationProbe:
    """One worker's part of the measures, on rows fixed for the whole run; ``autocast()`` gives
    the context every forward pass runs in (the step's: ``GovernedStep.autocast``)."""

    def __init__(
        self,
        trial: Trial,
        model: GovernedModel,
        routing: RoutingTable,
        manifest: ShardManifest,
        rows: RouteRows,
        policy: DepthPolicy,
        canaries: Mapping[str, CanaryProbe],
        seed: int,
        worker: Worker,
        split: bool = True,
        autocast: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.trial = trial
        self.autocast = autocast
        self.model = model
        self.routing = routing
        self.worker = worker
        # Split the measures' rows and batches across ranks; not under FSDP, where every forward
        # is a collective (all ranks run the same forwards, rank 0's values count).
        self.split = split or not worker.distributed
        self.layers = list(routing.layers)
        self.plans: list[_CorpusPlan] = []
        routes: dict[str, str] = {}  # credential JSON → route
        for corpus in manifest.corpora:
            probe = canaries.get(corpus.corpus_id)
            held = corpus.corpus_id in manifest.holdout
            if not corpus.train_rows or not (held or probe):
                continue  # nothing trained, or nothing to measure it against
            canary_rows = (
                {row for canary in probe.canaries.canaries for row in canary.rows} if probe else set()
            )
            holdout = rows.reader.empty()  # none held out: exposure only
            if held:
                holdout = rows.holdout_sample(corpus.corpus_id, PROBE_HOLDOUT_ROWS, exclude=canary_rows)
                holdout = _with_policy_routes(holdout, policy, routes)
            plan = _CorpusPlan(
                corpus_id=corpus.corpus_id,
                train_sample=rows.corpus_sample(
                    corpus.corpus_id, min(holdout.num_rows, LOSS_GAP_SAMPLE), exclude=canary_rows
                ),
                holdout=holdout,
            )
            size = min(PROBE_ROWS, holdout.num_rows // (CALIBRATION_BATCHES + 1))
            training = rows.corpus_sample(corpus.corpus_id, size, exclude=canary_rows)
            if size >= MIN_PROBE_ROWS and training.num_rows == size:
                for index in range(CALIBRATION_BATCHES):
                    plan.entropy_batches[f"calibration-{index}"] = holdout.slice(index * size, size)
                plan.entropy_batches[_CHECK] = holdout.slice(CALIBRATION_BATCHES * size, size)
                plan.entropy_batches[_TRAINING] = training
            if probe is not None:
                self._plan_canaries(plan, probe, rows, seed)
            self.plans.append(plan)
        with torch.no_grad():  # the model holds its initial weights: the reference of reference_loss
            self.model.eval()
            for plan in self.plans:
                for kind, table in self._samples(plan):
                    plan.initial_losses[kind] = self._scores(table, None, logits=False).get("loss")

    @staticmethod
    def _plan_canaries(plan: _CorpusPlan, probe: CanaryProbe, rows: RouteRows, seed: int) -> None:
        route_of = rows.routes_of(
            plan.corpus_id, {row for canary in probe.canaries.canaries for row in canary.rows}
        )
        for canary in probe.canaries.canaries:
            trained = sorted(row for row in canary.rows if row in route_of)
            if trained:  # every copy held out: never trained, so nothing to expose
                plan.canary_texts.setdefault(route_of[trained[0]], []).append(canary.text)
        rng = random.Random(derive_seed(seed, "canaries", plan.corpus_id))
        plan.references = probe.canaries.candidates(probe.references, rng) if plan.canary_texts else []

    @torch.no_grad()
    def measure(self) -> dict[str, CorpusMeasures]:
        """Every corpus's measures, the same on every rank."""
        self.model.eval()
        rank, world = (self.worker.rank, self.worker.world_size) if self.split else (0, 1)
        counted = self.split or self.worker.rank == 0  # whether this rank's values enter the sums
        sums: dict[str, float] = {}
        for plan in self.plans:
            for kind, mine in self._samples(plan):
                detected = self._scores(mine, plan.initial_losses[kind])
                if counted:  # a name no rank sent is absent; one some ranks sent, summed
                    for detector, values in detected.items():
                        sums[f"{detector}/{plan.corpus_id}/{kind}"] = float(values.sum())
                    sums[f"count/{plan.corpus_id}/{kind}"] = float(mine.num_rows)
        batches = [
            (plan.corpus_id, name, table)
            for plan in self.plans
            for name, table in plan.entropy_batches.items()
        ]
        for index, (corpus_id, name, table) in enumerate(batches):
            if index % world == rank:
                try:
                    profile = entropy_profile(self._representations(table))
                except ValueError:  # a NaN representation: no profile this time, on every rank
                    profile = {layer: math.nan for layer in self.layers}
                for layer, value in profile.items():
                    if counted:
                        sums[f"entropy/{corpus_id}/{name}/{layer}"] = value
        for plan in self.plans:
            for route, canaries in plan.canary_texts.items():
                texts = canaries + plan.references
                positions = range(rank, len(texts), world)
                if not positions:  # fewer texts than ranks (split: no forward holds a collective)
                    continue
                with self.model.active(self.routing.adapter_names.get(route)), self.autocast():
                    scores = self.trial.sequence_scores(self.model, [texts[i] for i in positions])
                for position, score in zip(positions, scores.tolist(), strict=True):
                    if counted:
                        sums[f"score/{plan.corpus_id}/{route}/{position}"] = float(score)
        totals = all_reduce_sums(sums, self.worker)
        return {plan.corpus_id: self._measures(plan, totals) for plan in self.plans}

    def _measures(self, plan: _CorpusPlan, totals: Mapping[str, float]) -> CorpusMeasures:
        corpus = plan.corpus_id
        gaps: dict[str, float] = {}
        counts = {kind: totals[f"count/{corpus}/{kind}"] for kind in ("train", "holdout")}
        for detector, name in DETECTOR_THRESHOLDS.items():
            keys = {kind: f"{detector}/{corpus}/{kind}" for kind in counts}
            if all(counts.values()) and all(key in totals for key in keys.values()):
                means = {kind: totals[keys[kind]] / counts[kind] for kind in counts}
                gaps[name] = gap_of_means(detector, means["train"], means["holdout"])
        drop = None
        profiles = {
            name: {layer: totals.get(f"entropy/{corpus}/{name}/{layer}", math.nan) for layer in self.layers}
            for name in plan.entropy_batches
        }
        if profiles and not any(math.isnan(v) for profile in profiles.values() for v in profile.values()):
            band = EntropyBand.calibrate([profiles[f"calibration-{i}"] for i in range(CALIBRATION_BATCHES)])
            drop = band.check(training=profiles[_TRAINING], holdout=profiles[_CHECK]).drop_bits
        bits = None
        if plan.canary_texts:
            exposures: list[float] = []
            for route, canaries in plan.canary_texts.items():
                scores = [
                    totals[f"score/{corpus}/{route}/{i}"] for i in range(len(canaries) + len(plan.references))
                ]
                references = scores[len(canaries) :]
                exposures.extend(exposure(score, references) for score in scores[: len(canaries)])
            bits = sum(exposures) / len(exposures)
        return CorpusMeasures(**gaps, exposure_bits=bits, entropy_drop=drop)

    def _samples(self, plan: _CorpusPlan) -> list[tuple[str, pa.Table]]:
        """This worker's part of the training sample and of the held-out rows."""
        tables = (("train", plan.train_sample), ("holdout", plan.holdout))
        return [(kind, self.worker.mine(table) if self.split else table) for kind, table in tables]

    def _scores(
        self, table: pa.Table, initial_losses: torch.Tensor | None, logits: bool = True
    ) -> dict[Detector, torch.Tensor]:
        """Every detector's per-example scores of ``table``'s rows (``detectors.example_scores``;
        ``logits`` False: the loss alone), route by route, in batches of the trial's batch size,
        in the order of ``_by_route``; none for an empty table."""
        parts: list[dict[Detector, torch.Tensor]] = []
        for route, part in _by_route(table):
            with self.model.active(self.routing.adapter_names.get(route)), self.autocast():
                for piece in row_batches(part, self.trial.batch_size):
                    batch = on_device(self.trial.collate(piece), self.worker.device)
                    losses = self.trial.loss(self.model, batch)
                    given = self.trial.predictions(self.model, batch) if logits else None
                    logit_input, targets, mask = predicted(given)
                    texts = piece.column("text").to_pylist() if "text" in piece.column_names else None
                    parts.append(example_scores(losses, logit_input, targets, mask, texts=texts))
        if not parts:
            return {}
        scores = {detector: torch.cat([part[detector] for part in parts]) for detector in parts[0]}
        if initial_losses is not None:
            scores["reference_loss"] = scores["loss"] - initial_losses
        return scores

    def _representations(self, table: pa.Table) -> dict[str, torch.Tensor]:
        """Each layer's representation of ``table``'s rows (route by route, concatenated)."""

        def forward() -> None:
            for route, part in _by_route(table):
                with self.model.active(self.routing.adapter_names.get(route)), self.autocast():
                    self.trial.loss(self.model, on_device(self.trial.collate(part), self.worker.device))

        return layer_representations(self.trial, self.model.base, self.layers, forward)


def layer_representations(
    hooks: ProbeHooks, model: nn.Module, layers: Sequence[str], forward: Callable[[], object]
) -> dict[str, torch.Tensor]:
    """Each of ``layers``' representation (``hooks.representation``, float32 on the CPU) of every
    example that ``forward()`` passes through ``model``, concatenated in forward order — what the
    entropy profile is computed on. Layers no forward reached are left out.

    Example::

        profile = entropy_profile(
            layer_representations(trial, model, ["embed", "hidden"], lambda: trial.loss(model, batch))
        )
    """
    modules = dict(model.named_modules())
    captured: dict[str, list[torch.Tensor]] = {layer: [] for layer in layers}
    handles = [
        modules[layer].register_forward_hook(
            lambda _module, _inputs, output, layer=layer: captured[layer].append(
                hooks.representation(layer, output).float().cpu()
            )
        )
        for layer in layers
    ]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(parts) for layer, parts in captured.items() if parts}


def _with_policy_routes(table: pa.Table, policy: DepthPolicy, cache: dict[str, str]) -> pa.Table:
    """``_route`` set to the route the policy gives each row's credential."""
    routes = []
    for text in table.column("_credential").to_pylist():
        if text not in cache:
            cache[text] = policy.route_key_for(Credential.model_validate_json(text))
        routes.append(cache[text])
    return table.set_column(table.schema.get_field_index("_route"), "_route", pa.array(routes, pa.string()))


def _by_route(table: pa.Table) -> list[tuple[str, pa.Table]]:
    return [
        (route, table.filter(pc.equal(table.column("_route"), route)))
        for route in sorted(set(table.column("_route").to_pylist()))
    ]
