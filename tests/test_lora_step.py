"""The DDP step of a LoRA job, in a persistent 2-process gloo group on the text corpora with a plain
GPT-2 trial (tests/helpers/plain_gpt2_trial.py: no empty-batch special case):

- tensors no route may update leave autograd: in a LoRA-only job no base tensor requires grad,
  there is no DDP, and the only bytes all-reduced are the adapters' (one flat fp32 buffer per
  step); with some base tensors trainable DDP's buckets hold exactly their bytes;
- every trainable tensor is fp32 when the base is built in bf16 (adapters, AdamW state, the
  reduction), the frozen base stays bf16;
- a replay without the adapter's corpus leaves the base bit-identical (fp32, and bf16 base with
  fp32 adapters), and the trial's loss never sees a batch of 0 rows, nor does a validation's
  evaluation or memorization probe hand it one where a rank has no rows to measure;
- an optimizer state saved before frozen tensors left autograd (indexed over every tensor) still
  loads.
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from govray.config.training import Precision
from govray.governance.policy import DepthPolicy
from govray.train.runspec import RunSpec
from tests.helpers.builders import governed_step

WORLD = 2
STEPS = 6
TRIAL = "tests.helpers.plain_gpt2_trial:PlainGPT2Trial"
RECORDS = "text-records"
ATTENTION = "transformer.h.*.attn.c_attn"
RULES = {  # the hf_lm example's rules (so its shards' routes), routed as each test needs
    "pii": {"sensitivity": ["pii", "special-category"]},
    "public": {"license_class": ["public-domain", "permissive"]},
    "licensed": {"license_class": "licensed", "sensitivity": ["public", "internal", "confidential"]},
}


def gpt2_policy(routes: dict[str, Any], adapters: dict[str, list[str]]) -> DepthPolicy:
    return DepthPolicy.model_validate(
        {
            "name": "gpt2-lora",
            "version": 1,
            "adapters": {
                name: {"kind": "lora", "targets": targets, "rank": 4, "alpha": 8}
                for name, targets in adapters.items()
            },
            "rules": [{"name": rule, "match": RULES[rule], "route": route} for rule, route in routes.items()],
        }
    )


# The story's job: each corpus to its own adapter, licensed text on the upper blocks only.
LORA_ONLY = gpt2_policy(
    {
        "pii": {"adapter": "records-lora"},
        "public": {"adapter": "public-lora"},
        "licensed": {"adapter": "licensed-lora"},
    },
    {
        "records-lora": [ATTENTION],
        "public-lora": [ATTENTION, "transformer.h.*.mlp.c_fc"],
        "licensed-lora": ["transformer.h.2.attn.c_attn", "transformer.h.3.attn.c_attn"],
    },
)
# Licensed text may update the upper blocks: DDP reduces those, the adapters stay outside it.
MIXED = gpt2_policy(
    {
        "pii": {"adapter": "records-lora"},
        "public": {"adapter": "public-lora"},
        "licensed": {"depth": {"min": 3}},
    },
    {"records-lora": [ATTENTION], "public-lora": [ATTENTION]},
)


@dataclass(frozen=True)
class Task:
    spec: str  # RunSpec JSON
    excluded: tuple[str, ...] = ()
    # Validate after the steps with the probe on this many held-out rows per corpus (None: no validation).
    probe_rows: int | None = None


def rank_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (task := tasks.get()) is not None:
        try:
            spec = RunSpec.model_validate_json(task.spec)
            results.put((rank, "ok", trained(spec, task.excluded, rank, task.probe_rows)))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def trained(
    spec: RunSpec, excluded: tuple[str, ...], rank: int, probe_rows: int | None = None
) -> dict[str, Any]:
    """``STEPS`` governed steps (then a validation, given ``probe_rows``); what the model, DDP, the
    collectives and the validation held."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from govray.train.control import probe
    from govray.train.parallel.worker import Worker

    spec = spec.model_copy(update={"excluded_corpora": excluded})
    probed = probe.PROBE_HOLDOUT_ROWS
    probe.PROBE_HOLDOUT_ROWS = probe_rows or probed  # (this process runs later tasks: restored below)
    try:
        governed = governed_step(spec, Worker.detect())
    finally:
        probe.PROBE_HOLDOUT_ROWS = probed
    model = governed.model
    adapters = [p for a in model.adapter_names() for p in model.adapter_parameters(a)]
    reduced: list[tuple[int, str]] = []  # (bytes, dtype) of every all_reduce of the steps
    plain = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append((tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return plain(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(STEPS):
            governed.step(step)
        governed.governor.check_finite()
    finally:
        dist.all_reduce = plain
    validation = (governed.evaluate(), governed.probe.measure()) if probe_rows is not None else None
    ddp = governed.forward if isinstance(governed.forward, DistributedDataParallel) else None
    buckets = None
    if ddp is not None:
        sizes = ddp._get_ddp_logging_data()["bucket_sizes"]
        buckets = sum(int(size) for size in str(sizes).split(",") if size.strip())
    state = governed.optimizer.state
    return {
        "trainable_base": {
            name: (p.numel() * p.element_size(), str(p.dtype))
            for name, p in model.base_named_parameters()
            if p.requires_grad
        },
        "frozen_dtypes": {str(p.dtype) for _, p in model.base_named_parameters() if not p.requires_grad},
        "ddp_bucket_bytes": buckets,
        "ddp": ddp is not None,
        "reduced": reduced,
        "adapter_bytes": sum(p.numel() * p.element_size() for p in adapters),
        "adapter_dtypes": {str(p.dtype) for p in adapters},
        "adapter_state_dtypes": {
            str(state[p][key].dtype) for p in adapters if p in state for key in ("exp_avg", "exp_avg_sq")
        },
        "stepped_adapters": sum(1 for p in adapters if p in state),
        "validation": validation[0] if validation is not None else None,
        "measures": {c: m.model_dump(mode="json") for c, m in validation[1].items()} if validation else None,
        "base": {n: t.detach().cpu().clone() for n, t in model.base_state().items()} if rank == 0 else None,
        "adapters": {
            a: {n: t.cpu().clone() for n, t in model.adapter_tensors(a).items()}
            for a in model.adapter_names()
        }
        if rank == 0
        else None,
    }


@pytest.fixture(scope="module")
def text_spec(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> RunSpec:
    """The hf_lm example's corpora ingested (routes pii, public, licensed), as a run spec of the
    plain GPT-2 trial (AdamW) under no policy yet."""
    from govray.platform.run.plan import plan_run
    from jobs.examples.digits.golden import opened
    from jobs.examples.hf_lm.golden import example_under

    root = tmp_path_factory.mktemp("lora-step")
    config, _store, checked, _experiment, ingested = opened(example_under(root, STEPS))
    plan = plan_run(config, checked, ingested.root, hparams=config.default_hparams(), trial_seed=0)
    spec = plan.named("lora-step", {})
    return spec.model_copy(update={"trial": TRIAL, "run_dir": str(root / "run")})


def governed_by(spec: RunSpec, policy: DepthPolicy, **hparams: Any) -> str:
    """``spec`` for the GPT-2 trial under ``policy`` (bf16 autocast when the base is bf16)."""
    from govray.train.trial import make_trial, resolve_trial_routes

    assert spec.settings is not None
    settings = spec.settings
    if hparams.get("dtype") == "bfloat16":
        settings = settings.model_copy(update={"precision": Precision.BF16})
    values = {**spec.hparams, **hparams}
    routing = resolve_trial_routes(policy, make_trial(spec.trial, values, settings))
    update = {"policy": policy, "routing": routing, "hparams": values, "settings": settings}
    return spec.model_copy(update=update).model_dump_json()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.helpers.gloo_group import persistent_group

    with persistent_group(rank_main, tmp_path_factory.mktemp("gloo"), WORLD, timeout=600) as run:

        def answers(task: Task) -> dict[int, dict[str, Any]]:
            found = run(task)
            for rank, (status, payload) in found.items():
                assert status == "ok", f"rank {rank}: {payload}"
            return {rank: payload for rank, (_, payload) in found.items()}

        yield answers


def test_a_lora_only_job_has_no_base_gradient_no_ddp_and_all_reduces_only_adapter_bytes(
    gloo: Any, text_spec: RunSpec
) -> None:
    answers = gloo(Task(governed_by(text_spec, LORA_ONLY)))
    for rank, answer in answers.items():
        assert answer["trainable_base"] == {}, f"rank {rank}: base tensors still require grad"
        assert not answer["ddp"], "no DDP without a trainable base tensor"
        assert answer["stepped_adapters"] > 0, "the adapters trained (so the count below is not vacuous)"
        # One flat buffer of every adapter per step: not one byte of base gradient.
        assert answer["reduced"] == [(answer["adapter_bytes"], "torch.float32")] * STEPS


def test_ddp_buckets_hold_exactly_the_trainable_base_tensors_and_adapters_are_reduced_apart(
    gloo: Any, text_spec: RunSpec
) -> None:
    answers = gloo(Task(governed_by(text_spec, MIXED)))
    for rank, answer in answers.items():
        trainable = answer["trainable_base"]
        assert trainable, "licensed text trains the upper blocks"
        assert all(
            name.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f."))
            for name in trainable
        )
        assert answer["ddp"]
        assert answer["ddp_bucket_bytes"] == sum(size for size, _ in trainable.values()), f"rank {rank}"
        base_bytes = sum(size for size, _ in trainable.values())
        assert sum(size for size, _ in answer["reduced"]) == STEPS * (base_bytes + answer["adapter_bytes"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_removing_the_adapter_is_the_replay_without_its_corpus_and_no_loss_sees_zero_rows(
    gloo: Any, text_spec: RunSpec, dtype: str
) -> None:
    """The replay's slots of the excluded corpus run a stand-in (the trial raises on 0 rows: any
    such call would fail the run); its base equals the run's bit for bit. bf16: the base is built
    in bf16, every trainable tensor (adapters, licensed's upper blocks) and its AdamW state and
    reduction are fp32, the frozen base stays bf16."""
    spec = governed_by(text_spec, MIXED, dtype=dtype)
    original = gloo(Task(spec))
    replay = gloo(Task(spec, excluded=(RECORDS,)))
    base, again = original[0]["base"], replay[0]["base"]
    assert base.keys() == again.keys()
    for name in base:
        assert torch.equal(base[name], again[name]), f"{name} differs in the replay without {RECORDS}"
    assert not torch.equal(
        original[0]["adapters"]["records-lora"]["adapter/records-lora/transformer.h.0.attn.c_attn.lora_B"],
        replay[0]["adapters"]["records-lora"]["adapter/records-lora/transformer.h.0.attn.c_attn.lora_B"],
    ), "the records adapter learned from its corpus in the run (the comparison is not vacuous)"
    for answer in (*original.values(), *replay.values()):
        assert answer["adapter_dtypes"] == answer["adapter_state_dtypes"] == {"torch.float32"}
        assert {dtype for _, dtype in answer["trainable_base"].values()} == {"torch.float32"}
        assert {dtype for _, dtype in answer["reduced"]} == {"torch.float32"}
        assert answer["frozen_dtypes"] == {f"torch.{dtype}"}


def test_a_validation_never_hands_the_trial_zero_rows_where_a_rank_has_none_to_measure(
    gloo: Any, text_spec: RunSpec
) -> None:
    """One held-out row per corpus evaluated and probed on two ranks (the second has none of either)
    in a replay without the records corpus: the trial raises on 0 rows, so a call with none would
    fail the validation; both ranks agree on every measure."""
    one_row = json.loads(governed_by(text_spec, MIXED))
    one_row["eval_rows"] = 1
    answers = gloo(Task(json.dumps(one_row), excluded=(RECORDS,), probe_rows=1))
    first, second = answers[0], answers[1]
    assert first["validation"] == second["validation"] and first["measures"] == second["measures"]
    corpora = ("text-public", "text-licensed", RECORDS)
    assert all(math.isfinite(first["validation"][f"validation_loss/{corpus}"]) for corpus in corpora)
    gaps = {corpus: measures["loss_gap"] for corpus, measures in first["measures"].items()}
    assert gaps.keys() == set(corpora) and all(gap is not None for gap in gaps.values()), gaps


def test_an_optimizer_state_indexed_over_frozen_tensors_too_is_refused(text_spec: RunSpec) -> None:
    """One layout at release: the optimizer holds the trainable tensors only (frozen ones left
    autograd before it was built), and a state indexed over every tensor of the model is refused,
    never re-indexed by guessing."""
    from govray.train.parallel.worker import Worker

    spec = RunSpec.model_validate_json(governed_by(text_spec, MIXED))
    first = governed_step(spec, Worker(0, 1))
    for step in range(3):
        first.step(step)
    saved = first.optimizer.state_dict()
    trainable = [p for group in first.optimizer.param_groups for p in group["params"]]
    every = [p for _, p in first.model.named_parameters()]
    assert len(every) > len(trainable), "some tensors are frozen"
    position = {id(p): index for index, p in enumerate(every)}
    over_every_tensor = {
        "state": {position[id(trainable[index])]: values for index, values in saved["state"].items()},
        "param_groups": [{**saved["param_groups"][0], "params": list(range(len(every)))}],
    }
    second = governed_step(spec, Worker(0, 1))
    with pytest.raises(ValueError, match="size"):
        second.load_optimizer_state(over_every_tensor)
    second.load_optimizer_state(saved)  # its own layout loads
    assert second.optimizer.state_dict()["state"].keys() == saved["state"].keys()


def test_a_clean_state_is_a_host_copy_restored_into_the_live_tensors(text_spec: RunSpec) -> None:
    """A DDP-path clean state holds weights and optimizer state in host memory (pinned on a GPU),
    shares no storage with the live tensors, and a rollback copies it back into them: after two
    more steps, loading it gives exactly the state of the clean state's step, in the same tensors."""
    from govray.train.parallel.worker import Worker

    spec = RunSpec.model_validate_json(governed_by(text_spec, MIXED))
    governed = governed_step(spec, Worker(0, 1))
    for step in range(2):
        governed.step(step)
    kept = governed.clean_state(2)
    clean = {name: tensor.clone() for name, tensor in governed.model.state_dict().items()}
    clean_optimizer = {
        index: {name: value.clone() for name, value in values.items()}
        for index, values in governed.optimizer.state_dict()["state"].items()
    }
    live = {tensor.data_ptr() for tensor in governed.model.state_dict().values()}
    assert all(tensor.device.type == "cpu" for tensor in kept.weights.values())
    assert not live & {tensor.data_ptr() for tensor in kept.weights.values()}
    parameters = {name: id(p) for name, p in governed.model.named_parameters()}
    for step in range(2, 4):
        governed.step(step)
    assert any(not torch.equal(t, clean[n]) for n, t in governed.model.state_dict().items())
    governed.load_clean_state(kept)
    assert {name: id(p) for name, p in governed.model.named_parameters()} == parameters
    for name, tensor in governed.model.state_dict().items():
        assert torch.equal(tensor, clean[name]), name
    restored = governed.optimizer.state_dict()["state"]
    for index, values in clean_optimizer.items():
        for name, value in values.items():
            assert torch.equal(restored[index][name], value), (index, name)


def test_the_attestation_states_fp32_trainables_and_the_frozen_bases_dtype(tmp_path: Path) -> None:
    """The provenance's ``precision``: the setting, trainable tensors in float32, and the dtype the
    frozen base tensors are stored in — bf16 for a LoRA-only job on a base built in bf16."""
    from govray.governance.adapter_files import save_base_tensors
    from govray.provenance.predicates import precision_statement
    from govray.train.trial import make_trial, resolve_trial_routes

    trial = make_trial(TRIAL, {"context": 32, "dtype": "bfloat16"}, None)
    save_base_tensors(trial.build_model().state_dict(), tmp_path / "model.safetensors")
    for policy, frozen in ((LORA_ONLY, ["bfloat16"]), (gpt2_policy({"public": "all"}, {}), [])):
        routing = resolve_trial_routes(policy, trial)
        assert precision_statement("bf16", routing, tmp_path) == {
            "setting": "bf16",
            "trainable": "float32",
            "frozen_base": frozen,
        }
