"""cluster.yaml passes Ray's own cluster-launcher validation (a broken copy does not), installs
govray at pyproject's version under constraints.txt, scales its workers from zero, and starts every
node with token authentication on."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.train import ScalingConfig

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster.yaml"
# In the setup line that fails a node whose installed govray is not the one cluster.yaml pins.
PINNED_VERSION = re.compile(r"pinned = '([^']+)'")


def load() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER.read_text())


def pip_installs(config: dict[str, Any]) -> list[list[str]]:
    """The arguments of every ``pip install`` in the setup commands (a node type's too)."""
    commands = config["setup_commands"] + config.get("head_setup_commands", [])
    for spec in config["available_node_types"].values():
        commands = commands + spec.get("worker_setup_commands", [])
    return [
        words[words.index("install") + 1 :]
        for words in (shlex.split(command, comments=True) for command in commands)
        if "pip" in words and "install" in words
    ]


def test_cluster_yaml_passes_rays_validator() -> None:
    validate_config(prepare_config(load()))


def test_a_node_type_without_resources_fails_validation() -> None:
    config = load()
    del config["available_node_types"]["gpu-worker"]["resources"]
    with pytest.raises(Exception, match="resources"):
        validate_config(prepare_config(config))


def test_workers_scale_from_zero_and_the_gpu_type_asks_for_a_gpu() -> None:
    config = load()
    node_types = config["available_node_types"]
    head = config["head_node_type"]
    assert node_types[head]["resources"]["CPU"] == 0  # training never lands on the head
    workers = {name: spec for name, spec in node_types.items() if name != head}
    assert workers, "no worker node types"
    for name, spec in workers.items():
        assert spec["min_workers"] == 0, name
        assert 0 < spec["max_workers"] <= config["max_workers"], name
    assert workers["gpu-worker"]["resources"]["GPU"] >= 1
    assert "GPU" not in workers["cpu-worker"]["resources"]


def test_setup_installs_pyprojects_version_of_govray_under_the_constraints() -> None:
    config = load()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [
        pin
        for command in config["setup_commands"]
        if "m.version('govray')" in command
        for pin in PINNED_VERSION.findall(command)
    ]
    assert pins == [project["version"]], "bump cluster.yaml's pinned govray with pyproject's version"
    assert config["file_mounts"]["~/govray"] == "."
    installs = pip_installs(config)
    assert ["--no-cache-dir", "-c", "~/govray/constraints.txt", "~/govray"] in installs  # not -e
    pinned = constraints()
    for arguments in installs:
        assert "-e" not in arguments and "--editable" not in arguments
        assert arguments[arguments.index("-c") + 1] == "~/govray/constraints.txt"
        for word in arguments:
            if word.startswith(("-", "~")):
                continue
            name, _, version = word.partition("==")
            assert name.lower() in pinned, f"{name} is not pinned in constraints.txt"
            # a build of the pinned version (torch==2.13.0+cu128), never another version
            assert not version or version.split("+")[0] == pinned[name.lower()], word


def constraints() -> dict[str, str]:
    """constraints.txt: name → pinned version."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pins = (line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    return {name.lower(): version.strip() for name, version in pins}


def test_the_gpu_worker_installs_the_cuda_build_of_the_pinned_torch_and_fails_setup_without_a_gpu() -> None:
    node_types = load()["available_node_types"]
    gpu_setup = node_types["gpu-worker"]["worker_setup_commands"]
    (install,) = [
        arguments for arguments in pip_installs({"setup_commands": gpu_setup, "available_node_types": {}})
    ]
    (torch_pin,) = [word for word in install if word.startswith("torch==")]
    local = torch_pin.partition("+")[2]
    assert local.startswith("cu"), f"{torch_pin}: not a CUDA build"
    assert f"--extra-index-url=https://download.pytorch.org/whl/{local}" in install
    assert any("torch.cuda.is_available()" in command for command in gpu_setup[1:])  # after the install
    assert "worker_setup_commands" not in node_types["cpu-worker"]  # CPU nodes keep the pinned wheel


def test_a_gpu_training_worker_fits_only_the_gpu_worker_type() -> None:
    """What the runner asks for a Ray Train worker of an experiment with ``use_gpu: true``."""
    asked = ScalingConfig(use_gpu=True, resources_per_worker={"CPU": 2})._resources_per_worker_not_none
    assert asked == {"CPU": 2, "GPU": 1}
    workers = {name: spec["resources"] for name, spec in load()["available_node_types"].items()}
    fits = [
        name for name, offered in workers.items() if all(offered.get(k, 0) >= v for k, v in asked.items())
    ]
    assert fits == ["gpu-worker"]


def test_every_node_starts_ray_with_token_auth_from_the_launching_users_token() -> None:
    config = load()
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [command for command in config[key] if "ray start" in command]
        assert "export RAY_AUTH_MODE=token;" in start, key
        assert "--metrics-export-port=8080" in start, key
    (head_start,) = [command for command in config["head_start_ray_commands"] if "ray start" in command]
    for flag in ("--dashboard-host=0.0.0.0", "--dashboard-port=8265", "--autoscaling-config="):
        assert flag in head_start


def test_nodes_reach_storage_through_instance_profiles_not_keys() -> None:
    config = load()
    for name, spec in config["available_node_types"].items():
        assert "Name" in spec["node_config"]["IamInstanceProfile"], name
    assert "AWS_SECRET_ACCESS_KEY" not in CLUSTER.read_text()
