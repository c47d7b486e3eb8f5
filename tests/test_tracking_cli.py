"""The experiment and trial commands: what they print from a tracking store (built here without
training), that `govray experiments` still works, and that refusals change nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from govray.cli import main
from govray.cli.common import console
from govray.core.logs import log_dir
from govray.tracking.audit import AuditLog
from govray.tracking.lineage import checkpoints, record_checkpoint
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointStatus, ExperimentState, MetricKind, TrialState
from tests.helpers.gc import experiment_config, single

FINGERPRINT = "f0" * 32
CONFIG_DIGEST = "c" * 64
POLICY_DIGEST = "d" * 64


@dataclass
class Tracked:
    """A store with experiment 'base' and its fork 'digits': trial a ran, trial b was cloned,
    trial c replays trial a."""

    url: str
    store: TrackingStore
    storage: Path
    parent_id: int
    experiment_id: int
    trial_a: int
    trial_b: int
    trial_c: int
    checkpoint_ids: dict[int, int]  # trial a's checkpoints by step

    def cli(self, *args: str) -> int:
        return main([*args, "--database", self.url])


@pytest.fixture
def tracked(database_url: str, tmp_path: Path) -> Iterator[Tracked]:
    url = database_url
    store = TrackingStore.open(url)
    storage = tmp_path / "storage"
    config = experiment_config(name="digits", searcher=single(metric="validation_loss")).model_dump_json()
    parent = store.create_experiment("base", config, "b" * 64, str(storage))
    experiment = store.create_experiment(
        "digits", config, CONFIG_DIGEST, str(storage), policy_digest=POLICY_DIGEST
    )
    assert parent.id is not None and experiment.id is not None
    store.set_parent(experiment.id, parent.id)
    store.set_experiment_state(experiment.id, ExperimentState.ACTIVE)
    store.request(experiment.id, "pause")
    store.record_corpora(
        experiment.id,
        [
            {
                "corpus_id": "digits-public",
                "role": "train",
                "fingerprint": FINGERPRINT,
                "rows": 900,
                "train_rows": 810,
                "holdout_rows": 90,
                "credential_json": "{}",
                "route_counts_json": "{}",
            }
        ],
    )
    a = store.create_trial(experiment.id, '{"lr": 0.1}', seed=7, ray_run_name="digits-run-a")
    assert a.id is not None
    store.set_trial_state(a.id, TrialState.COMPLETED)
    for step, loss in [(10, 0.9), (20, 0.55), (20, 0.5), (30, 0.45), (30, 0.4)]:
        store.log_metrics(a.id, step, MetricKind.TRAINING, {"training_loss": loss})
    for step, loss in [(10, 0.7), (20, 0.5), (30, 0.6)]:
        store.log_metrics(a.id, step, MetricKind.VALIDATION, {"validation_loss": loss})
    store.log_metrics(a.id, 20, MetricKind.VALIDATION, {"accuracy": 0.8})
    checkpoint_ids = {}
    for step in (10, 20, 30):
        directory = storage / "ray" / "digits-run-a" / f"checkpoint_{step}"
        directory.mkdir(parents=True)
        record = record_checkpoint(store, a.id, str(directory), step)
        assert record.id is not None
        checkpoint_ids[step] = record.id
    store.set_trial_world_history(a.id, [(0, 3), (12, 2), (24, 3)])  # an elastic run, resized twice
    store.record_decisions(
        a.id,
        [
            {"seq": 0, "step": 20, "kind": "lr_scale", "scale": 0.1, "metric": "validation_loss"},
            # A node's reclaim notice, as the driver records it (sealed at step 24, then resized).
            {
                "seq": 1,
                "step": 24,
                "kind": "preempted",
                "deadline_ms": 1795692251000,
                "nodes": {"node-a": [2]},
            },
        ],
        replayed=False,
    )
    b = store.create_trial(experiment.id, "{}", seed=8, cloned_from=a.id)
    assert b.id is not None
    store.set_trial_source(b.id, json.dumps({"checkpoint_id": checkpoint_ids[20], "step": 20}))
    c = store.create_trial(experiment.id, '{"lr": 0.1}', seed=7, replay_of=a.id)
    assert c.id is not None
    yield Tracked(url, store, storage, parent.id, experiment.id, a.id, b.id, c.id, checkpoint_ids)
    store.close()


def checkpoint_states(tracked: Tracked) -> dict[int, str]:
    return {record.step: record.state for record in checkpoints(tracked.store, tracked.trial_a)}


# -- experiment describe -----------------------------------------------------------------------


def test_describe_json_holds_state_lineage_policy_corpora_trials_checkpoints_and_decisions(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracked.cli("experiment", "describe", "digits", "--json") == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)

    created, updated = document.pop("created_at"), document.pop("updated_at")
    assert datetime.fromisoformat(created) <= datetime.fromisoformat(updated)
    storage = tracked.storage / "ray" / "digits-run-a"
    assert document == {
        "id": tracked.experiment_id,
        "name": "digits",
        "state": "active",
        "requested": "pause",
        "parent_id": tracked.parent_id,
        "parent_name": "base",
        "config_digest": CONFIG_DIGEST,
        "policy_digest": POLICY_DIGEST,
        "gc_policy": {"save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 1},
        "gc_policy_overridden": False,
        "corpora": [{"corpus_id": "digits-public", "role": "train", "rows": 900, "fingerprint": FINGERPRINT}],
        "trials": [
            {
                "id": tracked.trial_a,
                "state": "completed",
                "ray_run_name": "digits-run-a",
                "seed": 7,
                "kind": "original",
                "replay_of": None,
                "cloned_from": None,
                "source_checkpoint": None,
                "last_step": 30,
                "training_loss": {"step": 30, "value": 0.4},
                "validation": {
                    "accuracy": {"step": 20, "value": 0.8},
                    "validation_loss": {"step": 30, "value": 0.6},
                },
                "checkpoints": [
                    {
                        "id": tracked.checkpoint_ids[step],
                        "step": step,
                        "state": "active",
                        "path": str(storage / f"checkpoint_{step}"),
                    }
                    for step in (10, 20, 30)
                ],
                "decisions": [
                    {
                        "seq": 0,
                        "step": 20,
                        "kind": "lr_scale",
                        "payload": {"metric": "validation_loss", "scale": 0.1},
                        "replayed": False,
                    },
                    {
                        "seq": 1,
                        "step": 24,
                        "kind": "preempted",
                        "payload": {"deadline_ms": 1795692251000, "nodes": {"node-a": [2]}},
                        "replayed": False,
                    },
                ],
                "world_history": [[0, 3], [12, 2], [24, 3]],
            },
            {
                "id": tracked.trial_b,
                "state": "pending",
                "ray_run_name": None,
                "seed": 8,
                "kind": "original",
                "replay_of": None,
                "cloned_from": tracked.trial_a,
                "source_checkpoint": {"checkpoint_id": tracked.checkpoint_ids[20], "step": 20},
                "last_step": None,
                "training_loss": None,
                "validation": {},
                "checkpoints": [],
                "decisions": [],
                "world_history": [],
            },
            {
                "id": tracked.trial_c,
                "state": "pending",
                "ray_run_name": None,
                "seed": 7,
                "kind": "replay",
                "replay_of": tracked.trial_a,
                "cloned_from": None,
                "source_checkpoint": None,
                "last_step": None,
                "training_loss": None,
                "validation": {},
                "checkpoints": [],
                "decisions": [],
                "world_history": [],
            },
        ],
    }


def test_describe_prints_the_same_content_as_tables(
    tracked: Tracked, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console, "width", 400)  # no folded cells: one table row, one line
    assert tracked.cli("experiment", "describe", str(tracked.experiment_id)) == 0
    out = capsys.readouterr().out
    lines = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]

    for expected in [
        f"experiment {tracked.experiment_id} 'digits'",
        "state active",
        "requested pause",
        f"parent {tracked.parent_id} 'base'",
        f"config digest {CONFIG_DIGEST}",
        f"policy digest {POLICY_DIGEST}",
        "gc policy save_experiment_best=0 save_trial_best=1 save_trial_latest=1 (from the config)",
        f"digits-public train 900 {FINGERPRINT[:16]}",
        f"{tracked.trial_a} original completed digits-run-a 7 30 0.4 "
        "accuracy=0.8 (step 20), validation_loss=0.6 (step 30) -",
        f"trial {tracked.trial_a} workers: 3 from step 0, 2 from step 12, 3 from step 24 (2 resizes)",
        f"trial {tracked.trial_a} checkpoints",
        f"{tracked.checkpoint_ids[20]} 20 active {tracked.storage}/ray/digits-run-a/checkpoint_20",
        f"trial {tracked.trial_a} decisions",
        '0 20 lr_scale {"metric": "validation_loss", "scale": 0.1}',
        '1 24 preempted {"deadline_ms": 1795692251000, "nodes": {"node-a": [2]}}',
        f"trial {tracked.trial_b} checkpoints: none",
        f"trial {tracked.trial_b} decisions: none",
    ]:
        assert expected in lines, f"{expected!r} not in:\n{out}"
    trial_b = next(line for line in lines if line.startswith(f"{tracked.trial_b} original pending"))
    assert trial_b.startswith(f"{tracked.trial_b} original pending - 8 - - - ")
    assert f'"checkpoint_id": {tracked.checkpoint_ids[20]}' in trial_b
    assert f"{tracked.trial_c} replay of trial {tracked.trial_a} pending - 7 - - - -" in lines


def test_describe_of_an_unknown_experiment_exits_8(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracked.cli("experiment", "describe", "nope") == 8
    assert "no experiment 'nope'" in capsys.readouterr().err


# -- experiment list and the old plural name ---------------------------------------------------


def test_list_shows_the_parent_and_the_trials_with_their_replays_and_experiments_is_a_hidden_alias(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracked.cli("experiment", "list") == 0
    rows = [line.replace("│", " ").split() for line in capsys.readouterr().out.splitlines()]
    listed = {row[0]: row for row in rows if row and row[0].isdigit()}
    assert listed[str(tracked.parent_id)][:5] == [str(tracked.parent_id), "base", "created", "0", "-"]
    assert listed[str(tracked.experiment_id)][:7] == [
        str(tracked.experiment_id),
        "digits",
        "active",
        "3",
        "(1",
        "replay)",
        str(tracked.parent_id),
    ]

    assert tracked.cli("experiment", "describe", "digits", "--json") == 0
    singular = capsys.readouterr().out
    assert tracked.cli("experiments", "describe", "digits", "--json") == 0
    assert capsys.readouterr().out == singular

    assert main(["--help"]) == 0
    listed_first = [line.replace("│", " ").split()[:1] for line in capsys.readouterr().out.splitlines()]
    assert ["experiment"] in listed_first and ["trial"] in listed_first
    assert ["experiments"] not in listed_first


# -- experiment set gc-policy ------------------------------------------------------------------


def test_set_gc_policy_keeps_counts_not_given_applies_at_once_and_reports(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracked.cli("experiment", "set", "gc-policy", "digits", "--save-trial-latest", "0") == 0
    out = capsys.readouterr().out
    lines = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]

    assert (
        f"experiment {tracked.experiment_id} 'digits': GC policy save_experiment_best=0 save_trial_best=1 "
        "save_trial_latest=0 (was save_experiment_best=0 save_trial_best=1 save_trial_latest=1)"
    ) in lines
    assert "checkpoints kept: 1, deleted: 2" in lines
    ids, trial = tracked.checkpoint_ids, tracked.trial_a
    path = tracked.storage / "ray" / "digits-run-a"
    assert f"{ids[10]} {trial} 10 deleted {path}/checkpoint_10" in lines
    assert f"{ids[20]} {trial} 20 kept trial {trial} best" in lines
    assert f"{ids[30]} {trial} 30 deleted {path}/checkpoint_30" in lines
    assert checkpoint_states(tracked) == {10: "deleted", 20: "active", 30: "deleted"}
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint_20"]

    assert tracked.cli("experiment", "describe", "digits", "--json") == 0
    described = json.loads(capsys.readouterr().out)
    assert described["gc_policy"] == {"save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 0}
    assert described["gc_policy_overridden"] is True

    assert tracked.cli("experiment", "set", "gc-policy", "digits", "--save-experiment-best", "2") == 0
    assert "save_experiment_best=2 save_trial_best=1 save_trial_latest=0 (was save_experiment_best=0" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["--save-trial-best", "-1"],
            "Invalid value for '--save-trial-best': Input should be greater than or equal to 0",
        ),
        (
            ["--save-experiment-best=-3"],
            "Invalid value for '--save-experiment-best': Input should be greater",
        ),
        ([], "give at least one of --save-experiment-best, --save-trial-best, --save-trial-latest"),
    ],
)
def test_a_refused_gc_policy_change_exits_2_and_changes_nothing(
    tracked: Tracked, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    assert tracked.cli("experiment", "set", "gc-policy", "digits", *arguments) == 2

    assert message in " ".join(capsys.readouterr().err.split())
    assert tracked.store.get_experiment(tracked.experiment_id).gc_policy_json is None
    assert AuditLog(tracked.store).list() == []
    assert checkpoint_states(tracked) == {step: CheckpointStatus.ACTIVE for step in (10, 20, 30)}


# -- trial logs --------------------------------------------------------------------------------

RANK0 = [
    "2026-11-22T00:01:02.000000Z rank0 | epoch 1",
    "2026-11-22T00:01:04.000000Z rank0 | epoch 2 [loss 0.4]",
]
RANK1 = ["2026-11-22T00:01:03.000000Z rank1 | epoch 1"]


def write_logs(tracked: Tracked) -> Path:
    directory = log_dir(tracked.storage, "digits-run-a")
    directory.mkdir(parents=True)
    (directory / "rank-0.log").write_text("".join(line + "\n" for line in RANK0))
    (directory / "rank-1.log").write_text("".join(line + "\n" for line in RANK1))
    return directory


def test_trial_logs_prints_every_ranks_lines_merged_by_time(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    write_logs(tracked)

    assert tracked.cli("trial", "logs", str(tracked.trial_a)) == 0
    assert capsys.readouterr().out.splitlines() == [RANK0[0], RANK1[0], RANK0[1]]


def test_trial_logs_follow_prints_new_lines_until_the_trial_stops(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write_logs(tracked)
    tracked.store.set_trial_state(tracked.trial_a, TrialState.ACTIVE)
    later = "2026-11-22T00:01:05.000000Z rank1 | epoch 2"

    def finish() -> None:
        time.sleep(1.5)  # longer than the quiet second: an active trial is followed regardless
        with (directory / "rank-1.log").open("a") as log:
            log.write(later + "\n")
        tracked.store.set_trial_state(tracked.trial_a, TrialState.COMPLETED)

    writer = threading.Thread(target=finish)
    writer.start()
    started = time.monotonic()
    assert tracked.cli("trial", "logs", str(tracked.trial_a), "--follow") == 0
    writer.join()

    assert capsys.readouterr().out.splitlines() == [RANK0[0], RANK1[0], RANK0[1], later]
    assert 2.5 <= time.monotonic() - started < 6.0


def test_trial_logs_follow_of_a_finished_trial_prints_its_logs_and_ends(
    tracked: Tracked, capsys: pytest.CaptureFixture[str]
) -> None:
    write_logs(tracked)
    started = time.monotonic()

    assert tracked.cli("trial", "logs", str(tracked.trial_a), "--follow") == 0
    assert capsys.readouterr().out.splitlines() == [RANK0[0], RANK1[0], RANK0[1]]
    assert time.monotonic() - started < 3.0


def test_trial_logs_says_why_there_are_none(tracked: Tracked, capsys: pytest.CaptureFixture[str]) -> None:
    assert tracked.cli("trial", "logs", str(tracked.trial_b)) == 1
    assert f"trial {tracked.trial_b} (pending) has no Ray run name yet" in capsys.readouterr().err

    assert tracked.cli("trial", "logs", str(tracked.trial_a)) == 1
    expected = (
        f"trial {tracked.trial_a} (completed) has no worker logs in {tracked.storage}/logs/digits-run-a"
    )
    assert expected in " ".join(capsys.readouterr().err.split())

    assert tracked.cli("trial", "logs", "999") == 8
    assert "no trial with id 999" in capsys.readouterr().err
