"""cluster.yaml passes Ray's own cluster-launcher validation; a broken copy does not."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[1] / "cluster.yaml"


def load() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER.read_text())


def test_cluster_yaml_passes_rays_validator() -> None:
    config = load()
    validate_config(prepare_config(copy.deepcopy(config)))
    workers = config["available_node_types"]
    assert workers["gpu-worker"]["min_workers"] == 0 and workers["gpu-worker"]["resources"]["GPU"] == 1


def test_a_node_type_without_resources_fails_validation() -> None:
    config = load()
    del config["available_node_types"]["gpu-worker"]["resources"]
    with pytest.raises(Exception, match="resources"):
        validate_config(prepare_config(config))
