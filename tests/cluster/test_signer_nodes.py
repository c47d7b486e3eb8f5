"""Signers across nodes, end to end (issue 49): a Ray head without CPUs (as ``cluster.yaml``'s)
runs the launch and the signer that holds the platform's keys (``govray signer serve --listen``);
a second node, where both workers and so rank 0 run, has only a signer agent (``govray signer
agent``) at its settings' ``signer.socket``. Every checkpoint rank 0 writes there is read and
checked by the agent and signed by the head's signer (its record lists them), and verifies under
that signer's key. The certificates they authenticate each other with come from ``govray signer
tls-init``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from govray.core.keys import PublicKey, TrustConfig, load_trust, save_trust
from govray.train.checkpoints.files import find_checkpoints, verify_checkpoint
from tests.helpers.builders import REPO
from tests.helpers.governed_job import digits_experiment, finished_run
from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.ports import free_port

pytestmark = pytest.mark.cluster


@pytest.fixture
def short() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _govray(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "govray", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _started(
    command: list[str], socket: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "govray", *command],
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
    for _ in range(300):
        if socket.exists() or process.poll() is not None:
            break
        time.sleep(0.1)
    assert socket.exists(), log.read_text()
    return process


def test_rank_0_on_a_node_without_keys_seals_through_its_agent_and_the_heads_signer(
    short: Path, tmp_path: Path
) -> None:
    signer_dir, tls = short / "signer", short / "tls"
    secret = short / "passphrase"
    secret.write_text("correct horse battery\n")
    made = _govray("signer", "init", "--dir", str(signer_dir), "--passphrase-file", str(secret))
    assert made.returncode == 0, made.stderr
    assert _govray("signer", "tls-init", str(tls), "--host", "127.0.0.1").returncode == 0
    platform = PublicKey.model_validate(yaml.safe_load((signer_dir / "platform.pub").read_text()))
    port = free_port()
    head_socket, agent_socket = short / "head.sock", short / "agent.sock"
    example = digits_experiment(tmp_path / "run", steps=10)
    raw = yaml.safe_load(example.read_text())
    raw["policy"] = {"file": "policies/digits.policy.yaml"}  # (vouched for by the operator's trust)
    example.write_text(yaml.safe_dump(raw, sort_keys=False))
    trust = tmp_path / "operator-trust.yaml"
    authorities = load_trust(tmp_path / "run" / "policies" / "trust.yaml")
    save_trust(TrustConfig(keys=[*authorities.keys, platform]), trust)
    serve = ["signer", "serve", "--dir", str(signer_dir), "--passphrase-file", str(secret)]
    serve += ["--socket", str(head_socket), "--listen", f"127.0.0.1:{port}", "--tls", str(tls)]
    processes = [_started(serve, head_socket, short / "serve.log")]
    cluster = LocalRayCluster()
    try:
        agent = [
            "signer",
            "agent",
            "--head",
            f"127.0.0.1:{port}",
            "--tls",
            str(tls),
            "--socket",
            str(agent_socket),
        ]
        processes.append(
            _started(agent, agent_socket, short / "agent.log", cluster.environment(GOVRAY_TRUST=str(trust)))
        )
        cluster.start_head(
            num_cpus=0, env={"GOVRAY_SIGNER_SOCKET": str(head_socket), "GOVRAY_TRUST": str(trust)}
        )
        cluster.add_node(
            num_cpus=2, env={"GOVRAY_SIGNER_SOCKET": str(agent_socket), "GOVRAY_TRUST": str(trust)}
        )
        nodes = cluster.wait_for_nodes(2)
        (head,) = [node for node in nodes if node.is_head]
        (worker_node,) = [node for node in nodes if not node.is_head]
        driver = {"GOVRAY_SIGNER_SOCKET": str(head_socket), "GOVRAY_TRUST": str(trust)}
        run = cluster.govray("run", str(example), env=driver)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        cluster.stop()
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    finished = finished_run(example)
    assert set(finished.worker_nodes.values()) == {worker_node.node_id} != {head.node_id}
    checkpoints = find_checkpoints(finished.final_checkpoint.parent)
    assert checkpoints[-1].name == "checkpoint_00000010"  # (GC kept the latest)
    for folder in checkpoints:
        assert verify_checkpoint(folder, TrustConfig(keys=[platform]))[1] == platform.keyid
    said = (short / "agent.log").read_text()
    assert "(step 5) by 127.0.0.1" in said and "(step 10) by 127.0.0.1" in said  # (read there)
    seals = [json.loads(line) for line in (signer_dir / "state" / "seals.jsonl").read_text().splitlines()]
    assert [(Path(seal["run_dir"]).name, seal["step"]) for seal in seals] == [
        (finished.final_checkpoint.parent.name, 5),
        (finished.final_checkpoint.parent.name, 10),
    ]
