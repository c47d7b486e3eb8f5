"""Routing is resolved on a meta-device model: the examples and a transformers model give the same
table there as on a real one, without allocating a parameter; the table survives JSON (it travels in
run.json); a worker whose model resolves another table than the run's is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from pydantic import TypeAdapter
from torch import nn

from govray.config.training import TrainingSettings
from govray.core.errors import ConfigError, RoutingError
from govray.governance.policy import DepthPolicy, load_policy
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.runspec import RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.trial import Batch, Trial, make_trial, resolve_trial_routes

REPO = Path(__file__).resolve().parents[1]
DIGITS = "jobs.examples.digits.trial:DigitsTrial"
TEXT = "jobs.examples.text.trial:CharTransformerTrial"


class TinyGPT2Trial(Trial):
    """A two-block GPT-2 from a config: tied embedding and LM head, blocks as the ordered layers."""

    def build_model(self) -> nn.Module:
        config = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config)

    def layers(self, model: nn.Module) -> list[str]:
        return [
            "transformer.wte",
            "transformer.wpe",
            "transformer.h.0",
            "transformer.h.1",
            "transformer.ln_f",
        ]

    def collate(self, rows: Any) -> Batch:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError


class PretrainedTrial(TinyGPT2Trial):
    """Loads its weights: transformers refuses from_pretrained on the meta device."""

    def build_model(self) -> nn.Module:
        return transformers.GPT2LMHeadModel.from_pretrained(str(self.hparams["directory"]))


class PlacedTrial(TinyGPT2Trial):
    def build_model(self) -> nn.Module:
        return nn.Linear(2, 2, device="cpu")


def gpt2_policy() -> DepthPolicy:
    rules = [
        {"name": "upper", "match": {"license_class": "licensed"}, "route": {"depth": {"min": 3}}},
        {"name": "rest", "route": "all"},
    ]
    return DepthPolicy.model_validate({"name": "gpt2", "version": 1, "rules": rules})


def real_table(policy: DepthPolicy, trial: Trial) -> RoutingTable:
    torch.manual_seed(0)
    model = trial.build_model()
    return resolve_routes(policy, model, trial.layers(model))


@pytest.mark.parametrize(
    ("path", "hparams", "policy"),
    [
        (DIGITS, {"hidden": 24, "dropout": 0.1}, "digits.policy.yaml"),
        (TEXT, {"d_model": 32, "n_layers": 3}, "text.policy.yaml"),
    ],
)
def test_the_examples_resolve_on_the_meta_device_to_the_table_of_their_real_model(
    path: str, hparams: dict[str, Any], policy: str
) -> None:
    trial = make_trial(path, hparams)
    loaded = load_policy(REPO / "policies" / policy)
    assert resolve_trial_routes(loaded, trial) == real_table(loaded, trial)
    with torch.device("meta"):
        assert all(parameter.is_meta for parameter in trial.build_meta_model().parameters())


def test_a_transformers_model_resolves_on_the_meta_device_with_its_tied_head() -> None:
    trial = TinyGPT2Trial({})
    table = resolve_trial_routes(gpt2_policy(), trial)
    assert table == real_table(gpt2_policy(), trial)
    # the head is tied to the embedding (layer 0): the upper route may not update it
    assert not table.may_update("upper", "lm_head.weight")
    assert table.may_update("upper", "transformer.h.1.attn.c_attn.weight")
    assert not table.may_update("upper", "transformer.h.0.attn.c_attn.weight")


def test_resolving_routes_allocates_no_parameter_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build anywhere but on the meta device fails: routing never asks for one."""
    built = TinyGPT2Trial.build_model

    def only_on_meta(self: TinyGPT2Trial) -> nn.Module:
        if torch.get_default_device().type != "meta":
            raise AssertionError("the full model was built to resolve routes")
        return built(self)

    monkeypatch.setattr(TinyGPT2Trial, "build_model", only_on_meta)
    with pytest.raises(AssertionError, match="full model"):
        TinyGPT2Trial({}).build_model()
    resolve_trial_routes(gpt2_policy(), TinyGPT2Trial({}))


def test_a_trial_that_cannot_build_on_the_meta_device_is_told_how_to_fix_it(tmp_path: Path) -> None:
    TinyGPT2Trial({}).build_model().save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError, match="(?s)PretrainedTrial cannot build its model on the meta device.*build_meta_model"
    ):
        resolve_trial_routes(gpt2_policy(), PretrainedTrial({"directory": str(tmp_path)}))
    with pytest.raises(ConfigError, match="PlacedTrial put parameters on cpu"):
        resolve_trial_routes(gpt2_policy(), PlacedTrial({}))


def test_a_routing_table_survives_a_json_round_trip() -> None:
    table = resolve_trial_routes(
        load_policy(REPO / "policies" / "digits.policy.yaml"),
        make_trial(DIGITS, {"hidden": 8, "dropout": 0.0}),
    )
    tied = resolve_trial_routes(gpt2_policy(), TinyGPT2Trial({}))
    adapter = TypeAdapter(RoutingTable)
    for original in (table, tied):
        back = adapter.validate_json(adapter.dump_json(original))
        assert back == original and back.routes == original.routes
        assert back.tensor_layers() == original.tensor_layers()
    assert table.adapter_names  # the digits policy routes PII to an adapter: its targets came back


def spec_for(routing: RoutingTable, hidden: int) -> RunSpec:
    hparams = {"hidden": hidden, "dropout": 0.0}
    return RunSpec(
        trial=DIGITS,
        hparams=hparams,
        settings=TrainingSettings().with_hyperparameters(hparams),
        policy=load_policy(REPO / "policies" / "digits.policy.yaml"),
        routing=routing,
        policy_signer="unsigned",
        policy_trust_sha256="",
        shard_root="/nonexistent",
        shards_sha256="0" * 64,
        eval_rows=10,
        storage="/nonexistent",
        seed=1,
        trial_seed=0,
        max_steps=1,
        report_every=1,
    )


def test_a_worker_whose_model_resolves_another_table_than_the_runs_is_refused() -> None:
    policy = load_policy(REPO / "policies" / "digits.policy.yaml")
    planned = resolve_trial_routes(policy, make_trial(DIGITS, {"hidden": 8, "dropout": 0.0}))
    spec = spec_for(planned, hidden=16)  # the trial now builds another model than the run planned
    with pytest.raises(
        RoutingError, match="trial's code changed.*embed.weight \\(512 elements\\) in run.json"
    ):
        GovernedStep(WorkerContext.of(spec, Worker(0, 1)), make_trial(spec.trial, spec.hparams))
