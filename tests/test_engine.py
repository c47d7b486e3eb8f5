"""The engine at scale keeps every promise: with bf16 autocast and with gradient accumulation,
removing the adapter's corpus is the replay without it, bit for bit; the governed step reads
nothing from the device between boundaries; a non-finite gradient is refused at the next boundary,
naming its tensors and routes; the ledger kept per (corpus, route) expands to exactly the
per-(corpus, tensor) ledger."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from govray.data.schedule import RouteLayout, ScheduleEvent, ScheduleSpec
from govray.data.slots import step_slots
from govray.data.step_rows import step_rows
from govray.governance.allreduce import NonFiniteGradientError
from govray.platform.rerun.replay import Replay, recorded_decisions, replay_trial
from govray.train.checkpoints.files import MODEL_FILE, find_checkpoints
from govray.train.control.decisions import LossScaleSkip
from govray.train.parallel.worker import Worker
from govray.train.step.ledger import Ledger, TokensPerRow
from govray.train.step.scaling import INIT_SCALE
from jobs.examples.digits.golden import GOLDEN_HPARAMS
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.builders import governed_step
from tests.helpers.engine import run_spec
from tests.helpers.golden import GoldenRun, golden_run_at
from tests.helpers.routing import TABLE

ENGINE_STEPS = 12
FP16_STEPS = 18
ADAPTER_CORPUS = "digits-writers"


@dataclass
class Pair:
    original: GoldenRun
    replay: Replay  # ``govray replay --exclude-corpus digits-writers`` of the original


def _pair(
    root: Path, workers: int, training: dict[str, Any], steps: int = ENGINE_STEPS, **overrides: Any
) -> Pair:
    path = golden_example_at(
        root,
        workers=workers,
        max_length={"batches": steps},
        hparams=GOLDEN_HPARAMS,
        lr_schedule=False,
        training=training,
        **overrides,
    )
    original = golden_run_at(path)
    replay = replay_trial(
        original.store, original.config.name, (ADAPTER_CORPUS,), trial_id=original.outcome.trial_id
    )
    return Pair(original, replay)


@pytest.fixture(scope="module")
def bf16_pair(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """One worker in-process, bf16 autocast on the CPU."""
    return _pair(tmp_path_factory.mktemp("bf16"), 1, {"precision": "bf16"})


@pytest.fixture(scope="module")
def fp16_accumulation_pair(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """Two Ray Train workers (DDP: three micro-batches of each slot under no_sync, the last
    through the hook), fp16 with per-route loss scales, and the PII corpus's losses boosted so its
    route (the adapter's) overflows. 18 steps: the PII route is in 8 of them under this seed's
    schedule, so after its overflows have backed its scale off it also steps (the adapter learns)."""
    return _pair(
        tmp_path_factory.mktemp("fp16-accumulation"),
        2,
        {"precision": "fp16", "accumulation_steps": 4},
        steps=FP16_STEPS,
        trial="tests.helpers.overflow_trial:OverflowDigitsTrial",
    )


def final_files(run_dir: Path) -> dict[str, Path]:
    final = find_checkpoints(run_dir)[-1]
    return {path.name: path for path in final.iterdir() if path.suffix == ".safetensors"}


def assert_removal_is_the_replay(pair: Pair) -> None:
    original = final_files(pair.original.outcome.run_dir)
    replay = final_files(pair.replay.outcome.run_dir)
    assert original[MODEL_FILE].read_bytes() == replay[MODEL_FILE].read_bytes()
    adapter = load_file(str(original["adapter-pii-lora.safetensors"]))
    learned = [name for name, tensor in adapter.items() if name.endswith("lora_B") and bool(tensor.any())]
    assert learned, "the adapter learned from its corpus (so its exact absence from the base is not vacuous)"
    ledger = pair.original.outcome.ledger
    assert ledger is not None and pair.replay.outcome.ledger is not None
    assert {tensor for corpus, tensor in ledger.entries if corpus == ADAPTER_CORPUS} == {
        tensor for tensor in ledger.tensors() if tensor.startswith("adapter/pii-lora/")
    }
    assert {
        k: v for k, v in ledger.entries.items() if k[0] != ADAPTER_CORPUS
    } == pair.replay.outcome.ledger.entries


def test_bf16_removal_of_the_adapter_is_the_replay_without_its_corpus(bf16_pair: Pair) -> None:
    assert_removal_is_the_replay(bf16_pair)


@pytest.mark.cluster  # its 2-worker pair of runs (~75 s): the second tier
def test_accumulation_and_fp16_removal_of_the_adapter_is_the_replay_without_its_corpus(
    fp16_accumulation_pair: Pair,
) -> None:
    assert_removal_is_the_replay(fp16_accumulation_pair)


@pytest.mark.cluster  # its 2-worker pair of runs (~75 s): the second tier
def test_fp16_an_overflow_on_the_adapter_route_skips_only_its_tensors(fp16_accumulation_pair: Pair) -> None:
    """The injected overflow is attributed to the adapter's route alone: recorded skips name only
    it, the base stepped at those steps (bit-identical to the replay above, which has no adapter
    route and skipped nothing of the base that the original did not), and the replay applied
    the original's record for the routes it keeps."""
    original = recorded_decisions(
        fp16_accumulation_pair.original.store, fp16_accumulation_pair.original.outcome.trial_id
    )
    skips = [d for d in original if isinstance(d, LossScaleSkip)]
    adapter_only = [d for d in skips if d.routes == ["pii"]]
    assert adapter_only, f"the boosted PII losses overflowed (skips: {skips})"
    assert all(
        (d.scales and d.scales[0] < INIT_SCALE) or d.step == adapter_only[0].step for d in adapter_only
    )
    replayed = recorded_decisions(
        fp16_accumulation_pair.original.store, fp16_accumulation_pair.replay.outcome.trial_id
    )
    kept = [(d.step, d.routes) for d in skips if set(d.routes) - {"pii"}]
    assert [(d.step, d.routes) for d in replayed if isinstance(d, LossScaleSkip)] == [
        (step, [route for route in routes if route != "pii"]) for step, routes in kept
    ]


def test_bf16_really_ran_under_autocast(bf16_pair: Pair) -> None:
    """The same run in fp32 trains other weights (bf16's rounding is in the forward pass)."""
    spec = run_spec(bf16_pair.original)
    assert spec.settings is not None and spec.settings.precision == "bf16"
    weights = {}
    for precision in ("bf16", "fp32"):
        settings = spec.settings.model_copy(update={"precision": precision})
        governed = governed_step(spec, Worker(0, 1), settings)
        for step in range(3):
            governed.step(step)
        weights[precision] = governed.model.base_state()
    assert any(not torch.equal(weights["bf16"][name], weights["fp32"][name]) for name in weights["fp32"])


# -- no host sync in the step ------------------------------------------------------------------

HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"})


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor's value on the host (what waits for a GPU): ``item``,
    ``tolist``, ``numpy``, ``cpu``, and ``bool``/``float``/``int`` of a tensor. Reads of the
    ``optimizer``'s step counters are not counted: torch keeps those on the host by design
    (unless ``capturable``), so reading them never waits for a device."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and not self._host_counter(args[0]):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))

    def _host_counter(self, tensor: Any) -> bool:
        if self.optimizer is None:
            return False
        return any(state.get("step") is tensor for state in self.optimizer.state.values())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_governed_step_reads_nothing_from_the_device_between_boundaries(
    bf16_pair: Pair, optimizer: str
) -> None:
    spec = run_spec(bf16_pair.original)
    assert spec.settings is not None
    settings = spec.settings.model_copy(update={"accumulation_steps": 2}).with_hyperparameters(
        {"optimizer": optimizer, "lr": 0.01}
    )
    governed = governed_step(spec, Worker(0, 1), settings)
    governed.step(0)  # the first step builds the masks and layouts
    with HostReads(governed.optimizer) as counted:
        for step in range(1, 8):
            governed.step(step)
    assert counted.reads == []
    with HostReads() as boundary:
        governed.governor.check_finite()
    assert boundary.reads, "the boundary is where the device is read (the instrument sees reads)"


def test_a_non_finite_gradient_is_refused_at_the_next_boundary_naming_tensors_and_routes(
    bf16_pair: Pair,
) -> None:
    spec = run_spec(bf16_pair.original)
    governed = governed_step(spec, Worker(0, 1))
    loss = governed.trial.loss
    poisoned = next(
        step for step in range(2, 50) if step_slots(governed.schedule, step)[0].route == "licensed"
    )

    def nan_on_poisoned_step(model: Any, batch: Any) -> torch.Tensor:
        values = loss(model, batch)
        return values * float("nan") if governed.governor.step == poisoned else values

    governed.trial.loss = nan_on_poisoned_step  # type: ignore[method-assign]
    for step in range(poisoned + 2):
        governed.step(step)  # never waits: the flag stays on the device
    with pytest.raises(NonFiniteGradientError) as refused:
        governed.governor.check_finite()
    message = str(refused.value)
    assert message.startswith(f"step {poisoned}: ") and "(routes licensed, public)" in message
    assert f"after step {poisoned + 1}" in message
    upper = governed.routing.allowed("licensed")
    named = [name for name in upper if name in message]
    assert named and set(named) <= set(upper)
    governed.governor.check_finite()  # cleared: the next boundary sees nothing new


# -- the ledger, per (corpus, route) ---------------------------------------------------------


def random_spec(seed: int) -> ScheduleSpec:
    rng = random.Random(seed)
    corpora = ["wiki", "news", "books", "chats", "mail"]
    routes = []
    for route in ("public", "licensed", "pii"):
        chosen = rng.sample(corpora, rng.randint(1, 3))
        routes.append(RouteLayout(route, tuple((corpus, rng.randint(0, 25)) for corpus in chosen)))
    known = sorted({corpus for route in routes for corpus, rows in route.corpus_counts if rows})
    events = (
        (ScheduleEvent(step=rng.randint(0, 6), kind="gate", corpus_id=known[0]),)
        if rng.random() < 0.5
        else ()
    )
    return ScheduleSpec(
        seed=seed,
        world_size=rng.randint(1, 6),
        batch_size=rng.randint(1, 6),
        routes=tuple(routes),
        events=events,
    )


@pytest.mark.parametrize("seed", range(25))
def test_the_ledger_by_route_expands_to_exactly_the_ledger_by_tensor(seed: int) -> None:
    spec = random_spec(seed)
    tokens = {
        route.route: [random.Random(seed).randint(1, 9) for _ in range(route.rows)] for route in spec.routes
    }
    by_route, by_slot = Ledger(), Ledger()
    arrays = {route: np.asarray(counts) for route, counts in tokens.items()}
    for step in range(2 * spec.steps_per_epoch + 1):
        by_route.record_rows(step_rows(spec, step), TABLE, TokensPerRow(arrays))
        by_slot.record_step(step_slots(spec, step), TABLE, tokens)
        if step % 3 == 0:
            assert by_route.entries == by_slot.entries  # expanding midway changes nothing
    assert by_route.to_json() == by_slot.to_json()
    assert by_route.entries == reference_entries(spec, tokens, 2 * spec.steps_per_epoch + 1)


def reference_entries(spec: ScheduleSpec, tokens: dict[str, list[int]], steps: int) -> dict[Any, Any]:
    """Independent statement, slot by slot and tensor by tensor (wave 1's definition)."""
    from govray.train.step.ledger import LedgerEntry

    entries: dict[tuple[str, str], LedgerEntry] = {}
    for step in range(steps):
        reached = set()
        for item in step_slots(spec, step):
            if item.empty or item.route is None:
                continue
            for tensor in TABLE.updated_tensors(item.route):
                for row, corpus in zip(item.rows, item.corpora, strict=True):
                    entry = entries.setdefault((corpus, tensor), LedgerEntry())
                    entry.examples += 1
                    entry.tokens += tokens[item.route][row]
                    reached.add((corpus, tensor))
        for key in reached:
            entries[key].steps += 1
    return entries


@pytest.fixture(autouse=True)
def _no_leftover_modes() -> Iterator[None]:
    yield
    assert not torch.overrides._get_current_function_mode_stack()  # type: ignore[attr-defined]
