"""A run resumed on another world size continues its schedule exactly (issue 32, item 6; the
ground of elastic training): a step keeps the S slots it had when the run started, and a world
of W ranks runs them in ceil(S / W) rounds (``train.rounds``).

For the golden trial (three routes, the PII adapter, per-group clipping, AdamW with decay), the
public corpus excluded so that no slot may update the embedding:

- a 4-rank FSDP checkpoint resumed on 2 and on 3 ranks, a 2-rank DDP one on 1 rank and a
  1-rank one on 2: the resumed run, checkpointed again on its new world and resumed from there,
  ends bit for bit where the uninterrupted run on the new world ends; that run's weights equal
  the original world's within the fp32 summation order; the embedding is the initial one bit
  for bit; the ledger (from the schedule) is the original world's exactly; the world-size
  history is signed into the checkpoint;
- a 4-rank FSDP run shrunk to 2 ranks and grown back to 4 (an elastic run's resizes) continues
  exactly on the regrown world;
- a 4-rank HSDP checkpoint (2 shard groups of 2) continues exactly on 2 and 3 FSDP ranks and on
  6 HSDP ranks (3 groups), each rank reading its shards from the first replica's files;
- a flipped byte in a shard one rank reads is refused on every rank, naming the file.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from govray.config.experiment import ExperimentConfig, ParallelStrategy
from govray.core.settings import operator_trust
from govray.platform.rerun.resume import on_workers
from govray.train.checkpoints.files import shard_file
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.engine import run_spec
from tests.helpers.fsdp import ADAMW, PUBLIC, whole
from tests.helpers.gloo_group import persistent_group, rank_main
from tests.helpers.golden import GoldenRun

# The resumes are slow: gloo groups of 4, 2, 3 and 1 spawned ranks, each training the golden trial.
STEPS = 8
RESUME_AT = 3  # the original world's checkpoint
AGAIN_AT = 5  # the new world's own checkpoint
BACK_AT = 6  # a world grown back to the original size: its own checkpoint


def trained_spec(spec_json: str, strategy: str) -> Any:
    """The golden run's spec under ``strategy``, AdamW with decay, the public corpus excluded."""
    from govray.train.runspec import RunSpec

    spec = RunSpec.model_validate_json(spec_json)
    assert spec.settings is not None
    hparams = {**spec.hparams, **ADAMW}
    return spec.model_copy(
        update={
            "strategy": ParallelStrategy(strategy),
            "excluded_corpora": (PUBLIC,),
            "hparams": hparams,
            "settings": spec.settings.with_hyperparameters(hparams),
        }
    )


def opened(spec: Any, rank: int, world: int, run_dir: Path | None = None) -> Any:
    """The trial's state on this rank, its checkpoints sealed in ``run_dir`` (default the spec's)."""
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun
    from tests.helpers.signing import sealing_context

    worker = Worker.detect()
    assert (worker.rank, worker.world_size) == (rank, world)
    if run_dir is not None:
        spec = spec.model_copy(update={"run_dir": str(run_dir)})
    return TrialRun.open(sealing_context(spec, worker))


def step_folder(run_dir: Path, step: int) -> Path:
    """The checkpoint of ``step`` in ``run_dir`` (the signer seals a run's step-named folders)."""
    return run_dir / f"checkpoint_{step:08d}"


def fresh(folder: Path, rank: int, world: int) -> None:
    """``folder`` gone (an earlier task's), every rank waiting for it."""
    import torch.distributed as dist

    if rank == 0 and folder.exists():
        shutil.rmtree(folder)
    dist.barrier()


def at_start(folder: Path) -> Path:
    """Where ``original`` seals its starting state (a checkpoint at step 0 of run ``folder``)."""
    return step_folder(folder, 0)


def original(rank: int, world: int, spec_json: str, strategy: str, folder: Path) -> tuple[str, Any]:
    """The original world, run in directory ``folder``: a checkpoint at step 0 (``at_start``) and
    at RESUME_AT, then on to STEPS uninterrupted:
    ``("ok", (initial, final, ledger))`` on rank 0."""
    spec = trained_spec(spec_json, strategy)
    fresh(folder, rank, world)
    run = opened(spec, rank, world, folder)
    initial = whole(run.governed.model)
    run.save(at_start(folder), 0, {"step": 0})  # its starting state (a sharded run's step-0 one)
    for step in range(RESUME_AT):
        run.governed.step(step)
    run.save(step_folder(folder, RESUME_AT), RESUME_AT, {"step": RESUME_AT})
    for step in range(RESUME_AT, STEPS):
        run.governed.step(step)
    final = whole(run.governed.model)
    return "ok", (initial, final, run.governed.ledger.to_json()) if rank == 0 else None


def continued(
    rank: int, world: int, spec_json: str, strategy: str, source: Path, start: int, again_at: int, again: Path
) -> tuple[str, Any]:
    """On this world: resumed from ``source`` (its checkpoint at ``start``) and trained to STEPS
    uninterrupted; then resumed again, checkpointed in run directory ``again`` at ``again_at``,
    resumed from that and trained to STEPS:
    ``("ok", (uninterrupted, interrupted, ledger, slots, history))`` on rank 0, or
    ``("refused", message)``."""
    from govray.train.checkpoints.files import CheckpointError, load_checkpoint

    spec = trained_spec(spec_json, strategy)
    fresh(again, rank, world)
    reference = opened(spec, rank, world)
    try:
        assert reference.restore(source) == start
    except CheckpointError as error:
        return "refused", str(error)
    for step in range(start, STEPS):
        reference.governed.step(step)
    uninterrupted = whole(reference.governed.model)
    first = opened(spec, rank, world, again)
    first.restore(source)
    for step in range(start, again_at):
        first.governed.step(step)
    first.save(step_folder(again, again_at), again_at, {"step": again_at})
    second = opened(spec, rank, world)
    assert second.restore(step_folder(again, again_at)) == again_at
    for step in range(again_at, STEPS):
        second.governed.step(step)
    interrupted = whole(second.governed.model)
    history = load_checkpoint(step_folder(again, again_at), operator_trust(), rank).state.world_history
    slots = second.governed.schedule.world_size
    payload = (uninterrupted, interrupted, second.governed.ledger.to_json(), slots, history)
    return "ok", payload if rank == 0 else None


def started_on_slots(rank: int, world: int, spec_json: str, strategy: str, slots: int) -> tuple[str, Any]:
    """A fresh start on this world with ``slots`` slots per step (an elastic run's, or a replay's
    of a run that trained no step on its first world), trained to STEPS: ``("ok", weights)`` on
    rank 0."""
    spec = trained_spec(spec_json, strategy).model_copy(update={"slots_per_step": slots})
    run = opened(spec, rank, world)
    for step in range(STEPS):
        run.governed.step(step)
    final = whole(run.governed.model)
    return "ok", final if rank == 0 else None


def resumed(rank: int, world: int, spec_json: str, strategy: str, folder: Path) -> tuple[str, Any]:
    """``continued`` from the original world's checkpoint at RESUME_AT (of run ``folder``),
    checkpointed again at AGAIN_AT in run ``FOLDER-again-WORLD``."""
    again = folder.parent / f"{folder.name}-again-{world}"
    source = step_folder(folder, RESUME_AT)
    return continued(rank, world, spec_json, strategy, source, RESUME_AT, AGAIN_AT, again)


def regrown(rank: int, world: int, spec_json: str, strategy: str, again: Path) -> tuple[str, Any]:
    """``continued`` on a world grown back from a smaller world's checkpoint (at AGAIN_AT, of run
    ``again``), checkpointed again at BACK_AT."""
    back = again.parent / f"{again.name}-back-{world}"
    source = step_folder(again, AGAIN_AT)
    return continued(rank, world, spec_json, strategy, source, AGAIN_AT, BACK_AT, back)


def clean_checkpoint(rank: int, world: int, spec_json: str, strategy: str, folder: Path) -> tuple[str, Any]:
    """Under a memorization rollback policy, a checkpoint at RESUME_AT that is itself the clean
    state a rollback would return to."""
    from govray.governance.memorization import MemorizationThresholds

    spec = trained_spec(spec_json, strategy)
    thresholds = MemorizationThresholds(loss_gap=0.5, action="rollback")
    spec = spec.model_copy(
        update={"policy": spec.policy.model_copy(update={"memorization": thresholds}), "lr_schedule": None}
    )
    fresh(folder, rank, world)
    run = opened(spec, rank, world, folder)
    for step in range(RESUME_AT):
        run.governed.step(step)
    run.keep_clean(RESUME_AT)  # a validation found it clean
    run.save(step_folder(folder, RESUME_AT), RESUME_AT, {"step": RESUME_AT})
    return "ok", spec.model_dump_json()


@pytest.fixture(scope="module")
def signing_spec(golden_run: GoldenRun, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("world-resize")
    return run_spec(golden_run).model_copy(update={"run_dir": str(root / "run")})


def group(world: int, directory: Path) -> Any:
    return persistent_group(functools.partial(rank_main, world=world), directory, world, timeout=300)


@pytest.fixture(scope="module")
def four_rank_fsdp(signing_spec: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = Path(signing_spec.run_dir).parent / "fsdp-4"  # a run directory of its own
    with group(4, tmp_path_factory.mktemp("gloo4")) as run:
        answers = run((original, signing_spec.model_dump_json(), "fsdp", folder))
    assert all(status == "ok" for status, _ in answers.values()), answers
    return folder, answers[0][1]


@pytest.fixture(scope="module", params=[2, 3])
def smaller(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with group(request.param, tmp_path_factory.mktemp("gloo")) as run:
        yield request.param, run


def assert_continues_exactly(
    original_world: tuple[Any, Any, Any],
    payload: Any,
    slots: int,
    world: int,
    resumed_at: int,
    earlier: tuple[list[int], ...] = (),
) -> None:
    initial, final, ledger = original_world
    uninterrupted, interrupted, resumed_ledger, kept_slots, history = payload
    assert kept_slots == slots, "the schedule keeps the slots per step it started with"
    assert [list(entry) for entry in history] == [[0, slots], *earlier, [resumed_at, world]]
    embedding = [name for name in initial if name.startswith("base.embed.")]
    assert embedding and any(".lora_" in name for name in initial), (
        "forbidden tensors and the adapter in play"
    )
    for name in initial:
        assert torch.equal(interrupted[name], uninterrupted[name]), f"{name}: bit-identical continuation"
        if name in embedding:
            assert torch.equal(uninterrupted[name], initial[name]), f"{name}: no slot may update it"
        else:
            # Trained exactly where the original world trained it (a route with no slot yet: untouched).
            untouched = torch.equal(final[name], initial[name])
            assert torch.equal(uninterrupted[name], initial[name]) == untouched, name
            torch.testing.assert_close(uninterrupted[name], final[name], rtol=1e-5, atol=1e-6, msg=name)
    trained = [name for name in initial if not torch.equal(uninterrupted[name], initial[name])]
    assert len(trained) >= len(initial) - len(embedding) - 2, f"the comparison is not vacuous: {trained}"
    assert resumed_ledger == ledger, "the ledger counts every slot of every step, whatever the world"


@pytest.mark.slow
def test_a_four_rank_fsdp_checkpoint_continues_exactly_on_two_and_three_ranks(
    signing_spec: Any, four_rank_fsdp: tuple[Path, Any], smaller: tuple[int, Any]
) -> None:
    folder, original_world = four_rank_fsdp
    world, run = smaller
    answers = run((resumed, signing_spec.model_dump_json(), "fsdp", folder))
    for rank, (status, payload) in answers.items():
        assert status == "ok", (rank, payload)
    assert_continues_exactly(original_world, answers[0][1], slots=4, world=world, resumed_at=RESUME_AT)


@pytest.mark.slow
def test_fsdp_shrunk_from_four_ranks_to_two_and_grown_back_to_four_continues_exactly(
    signing_spec: Any, four_rank_fsdp: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An elastic FSDP run's 4 -> 2 -> 4 (issue 34): the 2-rank world's checkpoint at AGAIN_AT
    continues on 4 ranks exactly (bit-identical whether interrupted again or not), with the
    history [[0, 4], [RESUME_AT, 2], [AGAIN_AT, 4]] signed, the ledger the 4-rank one, the
    embedding untouched."""
    folder, original_world = four_rank_fsdp
    spec_json = signing_spec.model_dump_json()
    with group(2, tmp_path_factory.mktemp("gloo2")) as run:
        shrunk = run((resumed, spec_json, "fsdp", folder))
    assert all(status == "ok" for status, _ in shrunk.values()), shrunk
    again = folder.parent / f"{folder.name}-again-2"
    with group(4, tmp_path_factory.mktemp("gloo4")) as run:
        answers = run((regrown, spec_json, "fsdp", again))
    for rank, (status, payload) in answers.items():
        assert status == "ok", (rank, payload)
    assert_continues_exactly(
        original_world, answers[0][1], slots=4, world=4, resumed_at=AGAIN_AT, earlier=([RESUME_AT, 2],)
    )


@pytest.mark.slow
def test_a_step_0_checkpoint_resumed_on_two_ranks_trains_as_a_fresh_start_there_on_four_slots(
    signing_spec: Any, four_rank_fsdp: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A 4-rank FSDP run resumed on 2 ranks from its starting checkpoint (an elastic run's node lost
    before its first periodic checkpoint) trained every step on 2 ranks: its history is [[0, 2]]
    (the 4-rank world trained nothing), its 4 slots per step stay, and it ends bit for bit where a
    fresh 2-rank start planned on 4 slots ends (what its replay runs), with the 4-rank ledger."""
    folder, original_world = four_rank_fsdp
    spec_json = signing_spec.model_dump_json()
    again = folder.parent / f"{folder.name}-at-0-again-2"
    with group(2, tmp_path_factory.mktemp("gloo2")) as run:
        answers = run((continued, spec_json, "fsdp", at_start(folder), 0, AGAIN_AT, again))
        started = run((started_on_slots, spec_json, "fsdp", 4))
    for rank, (status, payload) in [*answers.items(), *started.items()]:
        assert status == "ok", (rank, payload)
    uninterrupted, interrupted, ledger, slots, history = answers[0][1]
    assert (slots, [list(entry) for entry in history]) == (4, [[0, 2]])
    fresh_start = started[0][1]
    assert uninterrupted.keys() == fresh_start.keys()
    for name in fresh_start:
        assert torch.equal(uninterrupted[name], fresh_start[name]), f"{name}: the replay's fresh start"
        assert torch.equal(interrupted[name], fresh_start[name]), f"{name}: interrupted again"
    assert any(not torch.equal(fresh_start[name], original_world[0][name]) for name in fresh_start)
    assert ledger == original_world[2], "the ledger counts every slot of every step"


@pytest.fixture(scope="module")
def four_rank_hsdp(signing_spec: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    """The original world under HSDP: 2 shard groups of 2 on 4 ranks (every rank writes its files)."""
    folder = Path(signing_spec.run_dir).parent / "hsdp-4"
    spec_json = signing_spec.model_copy(update={"shard_group": 2}).model_dump_json()
    with group(4, tmp_path_factory.mktemp("gloo4")) as run:
        answers = run((original, spec_json, "hsdp", folder))
    assert all(status == "ok" for status, _ in answers.values()), answers
    return folder, answers[0][1], spec_json


@pytest.mark.slow
def test_an_hsdp_checkpoint_continues_exactly_on_two_and_three_fsdp_ranks(
    four_rank_hsdp: tuple[Path, Any, str], smaller: tuple[int, Any]
) -> None:
    """Read from its first replica's files by verified ranges onto a world that is no multiple of
    its groups (a shrunk run, or an HSDP run moved to FSDP)."""
    folder, original_world, spec_json = four_rank_hsdp
    world, run = smaller
    answers = run((resumed, spec_json, "fsdp", folder))
    for rank, (status, payload) in answers.items():
        assert status == "ok", (rank, payload)
    assert_continues_exactly(original_world, answers[0][1], slots=4, world=world, resumed_at=RESUME_AT)


@pytest.mark.slow
def test_an_hsdp_run_continues_exactly_on_three_shard_groups(
    four_rank_hsdp: tuple[Path, Any, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``govray resume --workers 6`` of a 2 x 2 HSDP run: 3 groups of 2 on 6 ranks (two ranks'
    slots always empty) read their new shards from the 2 x 2 checkpoint and continue exactly."""
    folder, original_world, spec_json = four_rank_hsdp
    with group(6, tmp_path_factory.mktemp("gloo6")) as run:
        answers = run((resumed, spec_json, "hsdp", folder))
    for rank, (status, payload) in answers.items():
        assert status == "ok", (rank, payload)
    assert_continues_exactly(original_world, answers[0][1], slots=4, world=6, resumed_at=RESUME_AT)


@pytest.mark.slow
def test_a_flipped_byte_in_a_shard_one_rank_reads_is_refused_on_every_rank_naming_it(
    signing_spec: Any, four_rank_fsdp: tuple[Path, Any], smaller: tuple[int, Any], tmp_path: Path
) -> None:
    """A copy of the 4-rank checkpoint with a byte flipped in source rank 3's model shard (rows
    only the last new rank reads)."""
    source, _ = four_rank_fsdp
    _, run = smaller
    folder = tmp_path / "tampered"
    shutil.copytree(step_folder(source, RESUME_AT), step_folder(folder, RESUME_AT))
    tampered = step_folder(folder, RESUME_AT) / shard_file("model", 3, 4)
    data = bytearray(tampered.read_bytes())
    data[-5] ^= 0x01
    tampered.write_bytes(bytes(data))
    for rank, (status, message) in run((resumed, signing_spec.model_dump_json(), "fsdp", folder)).items():
        assert status == "refused", (rank, status, message)
        assert str(tampered) in message and "does not match" in message, message


@pytest.mark.slow
def test_a_ddp_checkpoint_continues_exactly_on_one_rank_fewer_and_one_more(
    signing_spec: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """2 ranks -> 1 (two rounds a step) and 1 rank -> 2 (the second rank's slot always empty)."""
    spec = signing_spec.model_dump_json()
    pair, single = (
        Path(signing_spec.run_dir).parent / "ddp-2",
        Path(signing_spec.run_dir).parent / "ddp-1",
    )
    with group(2, tmp_path_factory.mktemp("gloo2")) as two, group(1, tmp_path_factory.mktemp("gloo1")) as one:
        written = {2: two((original, spec, "ddp", pair)), 1: one((original, spec, "ddp", single))}
        for answers in written.values():
            assert all(status == "ok" for status, _ in answers.values()), answers
        on_one, on_two = one((resumed, spec, "ddp", pair)), two((resumed, spec, "ddp", single))
    for answers in (on_one, on_two):
        assert all(status == "ok" for status, _ in answers.values()), answers
    assert_continues_exactly(written[2][0][1], on_one[0][1], slots=2, world=1, resumed_at=RESUME_AT)
    assert_continues_exactly(written[1][0][1], on_two[0][1], slots=1, world=2, resumed_at=RESUME_AT)


def test_a_resume_on_another_world_size_is_asked_with_workers_and_validated_as_a_config() -> None:
    """``govray resume --workers N``: the recorded config with ``resources.workers`` N, everything
    else as it was; a world the strategy cannot run is refused as a config is."""
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config = ExperimentConfig.model_validate({**raw, "resources": {"strategy": "fsdp", "workers": 4}})
    assert on_workers(config, None) is config and on_workers(config, 4) is config
    three = on_workers(config, 3)
    assert three.resources.workers == 3
    assert three.model_copy(update={"resources": config.resources}) == config
    with pytest.raises(
        ValueError, match="strategy fsdp shards the model across workers: it needs workers >= 2"
    ):
        on_workers(config, 1)


def test_a_workers_rounds_sum_each_slots_masked_average_with_exact_zeros() -> None:
    """One worker running a step's two slots (routes a and b) in rounds: each tensor's gradient is
    the sum over the slots allowed to update it, each divided by the step's count for it (the
    multiplications the governor does, bit for bit); a slot's forbidden gradient — a NaN here —
    contributes an exact zero, not a NaN."""
    from torch import nn

    from govray.governance.allreduce import GradientGovernor
    from govray.train.parallel.rounds import RoundSums

    generator = torch.Generator().manual_seed(0)
    names = ("shared", "only_a", "only_b")
    parameters = [nn.Parameter(torch.randn(size, generator=generator)) for size in (3, 2, 4)]
    allowed = [frozenset({"a", "b"}), frozenset({"a"}), frozenset({"b"})]
    governor = GradientGovernor(list(zip(names, parameters, strict=True)), allowed)
    counts = {"a": 2, "b": 3}
    grads = {route: [torch.randn(p.shape, generator=generator) for p in parameters] for route in counts}
    grads["b"][1] = torch.full_like(grads["b"][1], float("nan"))  # b may not update only_a
    sums = RoundSums()
    for number, route in enumerate(counts):
        if number == 0:
            governor.begin_step(0, route, counts)
        else:
            governor.begin_round(route)
        for parameter, grad in zip(parameters, grads[route], strict=True):
            parameter.grad = grad.clone()
        governor.govern_local()
        sums.set_aside(parameters)
        assert all(parameter.grad is None for parameter in parameters)
    sums.put_back()
    governor.finish_step()

    def inverse(count: int) -> torch.Tensor:
        return torch.tensor([1.0 / count], dtype=torch.float32)

    shared, only_a, only_b = (parameter.grad for parameter in parameters)
    assert shared is not None and only_a is not None and only_b is not None
    assert torch.equal(shared, grads["a"][0] * inverse(5) + grads["b"][0] * inverse(5))
    assert torch.equal(only_a, grads["a"][1] * inverse(2))
    assert torch.equal(only_b, grads["b"][2] * inverse(3))
    assert governor.flags(torch.device("cpu")).sum() == 0, "the forbidden NaN raised no flag"


@pytest.mark.slow
def test_a_rollback_target_in_another_layout_is_refused_by_a_sharded_run_on_every_rank(
    signing_spec: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A 1-worker checkpoint that is the run's clean state, resumed by 2 FSDP ranks: they could
    neither carry its shard files into their next checkpoint nor roll back to them, so both
    refuse it, saying why."""
    folder = Path(signing_spec.run_dir).parent / "clean-1"
    with group(1, tmp_path_factory.mktemp("gloo1")) as one:
        ((status, spec),) = one((clean_checkpoint, signing_spec.model_dump_json(), "ddp", folder)).values()
    assert status == "ok", spec
    with group(2, tmp_path_factory.mktemp("gloo2")) as two:
        answers = two((resumed, spec, "fsdp", folder))
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status, message)
        assert (
            "a rollback target (a clean state) unsharded (one whole file); this run (sharded over 2 workers)"
            in message
        ), message
