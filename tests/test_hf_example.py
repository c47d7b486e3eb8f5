"""The Hugging Face example's promises through the real runner (Ray Train, 1 worker, a few steps):
licensed prose never changes the lower blocks or the tied embeddings, PII records reach only their
PEFT adapter, and removing the adapter equals the replay without the PII corpus, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from govray.data.schedule import derive_seed
from govray.platform.rerun.replay import replay_trial
from govray.tracking.lineage import checkpoints, ledger_rows
from govray.train.checkpoints.files import MODEL_FILE
from govray.train.runspec import RUN_SPEC_FILE, RunSpec
from jobs.examples.digits.golden import opened
from jobs.examples.hf_lm.golden import example_under
from jobs.examples.hf_lm.trial import TinyLlamaTrial

STEPS = 6
LOWER = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")  # below licensed's depth range


def model_files(store: Any, trial_id: int) -> dict[int, Path]:
    return {c.step: Path(c.path) for c in checkpoints(store, trial_id) if c.state == "active"}


@pytest.fixture(scope="module")
def hf_runs(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, int, int]:
    """A run without the public corpus (only licensed prose and PII records train), and its replay
    without the PII records: ``(store, run trial id, replay trial id)``."""
    from govray.platform.run.runner import run_trial

    path = example_under(tmp_path_factory.mktemp("hf-lm"), STEPS)
    config, store, checked, experiment, ingested = opened(path)
    outcome = run_trial(
        config, checked, experiment, ingested.root, store, excluded_corpora=("text-public",), report_every=3
    )
    # A replay of an original leaves out only what it is told (not what run_trial excluded).
    replay = replay_trial(store, config.name, ("text-public", "text-records"), trial_id=outcome.trial_id)
    return store, outcome.trial_id, replay.outcome.trial_id


def test_licensed_prose_leaves_the_lower_blocks_and_tied_embeddings_at_their_init(
    hf_runs: tuple[Any, int, int],
) -> None:
    store, run, _ = hf_runs
    final = model_files(store, run)[STEPS]
    spec = RunSpec.model_validate_json((final / RUN_SPEC_FILE).read_text())
    torch.manual_seed(derive_seed(spec.seed, spec.trial_seed, "init"))  # as the governed step builds it
    initial = TinyLlamaTrial(spec.hparams).build_model().state_dict()
    trained = load_file(str(final / MODEL_FILE))
    assert trained.keys() == initial.keys()  # the user's names: no PEFT base_layer in the file
    for name, tensor in trained.items():
        if name.startswith(LOWER) or name == "lm_head.weight":
            assert torch.equal(tensor, initial[name]), name
        elif name.startswith("model.layers.3.mlp."):
            assert not torch.equal(tensor, initial[name]), name  # licensed trained the upper blocks
    reached = {(row.corpus_id, row.parameter) for row in ledger_rows(store, run)}
    assert {corpus for corpus, _ in reached} == {"text-licensed", "text-records"}
    assert not any(p.startswith(LOWER) or p == "lm_head.weight" for c, p in reached if c == "text-licensed")
    assert all(p.startswith("adapter/records-lora/") for c, p in reached if c == "text-records")


def test_removing_the_adapter_equals_the_replay_without_the_pii_records(
    hf_runs: tuple[Any, int, int],
) -> None:
    store, run, replay = hf_runs
    original, replayed = model_files(store, run), model_files(store, replay)
    assert sorted(original) == sorted(replayed) == [STEPS // 2, STEPS]
    for step in original:
        base = (original[step] / MODEL_FILE).read_bytes()
        assert base == (replayed[step] / MODEL_FILE).read_bytes(), f"base differs at step {step}"
    adapter = "adapter-records-lora.safetensors"
    assert (original[STEPS] / adapter).read_bytes() != (replayed[STEPS] / adapter).read_bytes()


def test_the_trained_adapter_exported_in_peft_layout_loads_with_peft_and_gives_govrays_logits(
    hf_runs: tuple[Any, int, int], tmp_path: Path
) -> None:
    """``govray export peft-adapter`` of the final checkpoint: ``PeftModel.from_pretrained`` on a
    plain copy of the base model gives exactly the logits of govray's model with the adapter
    active; a tampered adapter file is refused before anything is written."""
    from peft import PeftModel

    from govray.cli import main
    from govray.core.keys import platform_key, platform_trust, save_trust
    from govray.governance.adapter_files import load_adapter
    from govray.governance.adapters import GovernedModel

    store, run, _ = hf_runs
    final = model_files(store, run)[STEPS]
    trust = tmp_path / "trust.yaml"
    save_trust(platform_trust(platform_key()), trust)
    out = tmp_path / "peft"
    command = ["export", "peft-adapter", "--checkpoint", str(final), "--adapter", "records-lora"]
    assert main([*command, "--out", str(out), "--trust", str(trust)]) == 0
    assert {path.name for path in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    spec = RunSpec.model_validate_json((final / RUN_SPEC_FILE).read_text())
    trial = TinyLlamaTrial(spec.hparams)
    ids = trial.collate(_rows(["Jane Doe, 12 Example Street", "The quick brown fox"]))["ids"]
    governed = GovernedModel(trial.build_model(), spec.routing, spec.policy.adapters, seed=0)  # type: ignore[arg-type]
    governed.load_base_state(load_file(str(final / MODEL_FILE)))
    load_adapter(governed, "records-lora", final / "adapter-records-lora.safetensors")
    governed.eval()
    with torch.no_grad(), governed.active("records-lora"):
        expected = governed(ids).logits
    plain = trial.build_model()
    plain.load_state_dict(load_file(str(final / MODEL_FILE)))
    peft_model = PeftModel.from_pretrained(plain, str(out)).eval()
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, expected)

    tampered = tmp_path / "tampered"
    shutil.copytree(final, tampered)
    weights = bytearray((tampered / "adapter-records-lora.safetensors").read_bytes())
    weights[-1] ^= 1
    (tampered / "adapter-records-lora.safetensors").write_bytes(bytes(weights))
    refused = tmp_path / "refused"
    command = ["export", "peft-adapter", "--checkpoint", str(tampered), "--adapter", "records-lora"]
    assert main([*command, "--out", str(refused), "--trust", str(trust)]) != 0
    assert not refused.exists()


def _rows(texts: list[str]) -> Any:
    import pyarrow as pa

    return pa.table({"text": texts})
