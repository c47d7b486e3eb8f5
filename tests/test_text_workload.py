"""The text workload: committed corpora are what make_corpora.py writes, the model's layers cover
every parameter once, the policy's adapter hooks into it, and it memorizes canaries (no Ray)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from govray.governance.adapters import GovernedModel
from govray.governance.canaries import CanarySet
from govray.governance.policy import load_policy
from govray.governance.routing import resolve_routes
from jobs.examples.text.make_corpora import DATA, ROW_CHARS, source_problem, write_corpora
from jobs.examples.text.trial import CharTransformer, CharTransformerTrial

REPO = Path(__file__).resolve().parents[1]
POLICY = REPO / "policies" / "text.policy.yaml"


def records() -> list[dict[str, str]]:
    with open(DATA / "records.jsonl") as handle:
        return [json.loads(line) for line in handle]


def small_model(trial: CharTransformerTrial) -> CharTransformer:
    torch.manual_seed(0)
    model = trial.build_model()
    assert isinstance(model, CharTransformer)
    return model


def test_committed_corpora_are_what_make_corpora_writes(tmp_path: Path) -> None:
    problem = source_problem()
    if problem is not None:
        pytest.skip(f"cannot regenerate: {problem}")
    write_corpora(tmp_path)
    committed = sorted(path.name for path in DATA.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == committed
    for name in committed:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_every_row_is_one_fixed_length_text_and_canaries_sit_where_recorded() -> None:
    rows = records()
    assert all(len(row["text"]) == ROW_CHARS for row in rows)
    canaries = CanarySet.load(DATA / "canaries.json")
    assert len(canaries.canaries) == 10 and canaries.space_size == 10**6
    for canary in canaries.canaries:
        assert len(canary.rows) == canaries.repeats
        assert {rows[row]["text"].rstrip("\n") for row in canary.rows} == {canary.text}
    references = canaries.candidates(500, random.Random(0))
    assert len(set(references)) == 500
    assert not set(references) & {canary.text for canary in canaries.canaries}


def test_layers_cover_every_parameter_exactly_once() -> None:
    trial = CharTransformerTrial({"n_layers": 3})
    model = small_model(trial)
    layers = trial.layers(model)
    assert layers == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    for name, _ in model.named_parameters(remove_duplicate=False):
        holders = [layer for layer in layers if name.startswith(layer + ".")]
        assert len(holders) == 1, f"{name} lies in {holders}"


def test_policy_adapter_changes_only_the_active_forward() -> None:
    trial = CharTransformerTrial({})
    base = small_model(trial)
    policy = load_policy(POLICY)
    routing = resolve_routes(policy, base, trial.layers(base))
    assert routing.allowed("licensed") == tuple(
        name for name, _ in base.named_parameters() if name.startswith(("blocks.1.", "head."))
    )
    model = GovernedModel(base, routing, policy.adapters, seed=0)
    with torch.no_grad():
        for parameter in model.adapter_parameters("records-lora"):
            parameter.normal_(std=0.1)
    ids = trial.collate(pa.Table.from_pylist(records()[:4]))["text"]
    plain = base(ids)
    with model.active("records-lora"):
        adapted = model(ids)
    assert torch.equal(model(ids), plain)  # inactive: the base output itself
    assert not torch.allclose(adapted, plain)  # active: every target's hook fires in forward


def test_trained_canaries_score_far_below_never_trained_candidates() -> None:
    canaries = CanarySet.load(DATA / "canaries.json")
    rows = records()
    canary_rows = {row for canary in canaries.canaries for row in canary.rows}
    others = [row for number, row in enumerate(rows) if number not in canary_rows][:300]
    training = [rows[number] for number in sorted(canary_rows)] + others
    trial = CharTransformerTrial({"lr": 3e-3, "batch_size": 32})
    model = small_model(trial)
    optimizer = trial.build_optimizer(model.parameters())
    texts = trial.collate(pa.Table.from_pylist(training))["text"]
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = texts[torch.randint(0, len(texts), (trial.batch_size,), generator=generator)]
        trial.loss(model, {"text": batch}).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    inserted = trial.sequence_scores(model, [canary.text for canary in canaries.canaries])
    references = trial.sequence_scores(model, canaries.candidates(200, random.Random(1)))
    # Every canary ranks first among 200 candidates of its template (exposure log2(201) ≈ 7.7 bits).
    assert float(inserted.max()) < float(references.min())
    assert float(inserted.mean()) < float(references.mean()) - 10.0  # nats
