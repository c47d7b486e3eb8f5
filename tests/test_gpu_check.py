"""``python -m jobs.gpu_check`` on a machine without a GPU says so in one line and exits 0; the
run it would start on a GPU is a valid experiment: the HF example on one Ray Train worker with
``use_gpu`` (NCCL), in bf16, with a corpus routed to a LoRA adapter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from govray.cli import main
from govray.config.experiment import load_experiment
from govray.config.training import Precision
from jobs.gpu_check import gpu_experiment, gpu_test_files, no_gpu_line

REPO = Path(__file__).resolve().parents[1]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jobs.gpu_check"],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [no_gpu_line()]
    assert done.stdout.startswith("gpu_check: no CUDA GPU on this machine (torch ")
    assert done.stdout.rstrip().endswith("nothing ran")


def test_the_gpu_run_is_the_hf_example_on_one_nccl_worker_in_bf16_with_a_lora_route(tmp_path: Path) -> None:
    config = load_experiment(gpu_experiment(tmp_path, steps=6))
    assert config.trial == "jobs.examples.hf_lm.trial:TinyLlamaTrial"
    assert (config.resources.workers, config.resources.use_gpu) == (1, True)  # Ray Train: NCCL
    assert config.training.precision == Precision.BF16
    assert config.searcher.max_length is not None
    policy = yaml.safe_load(Path(config.policy.file).read_text())
    assert any("adapter" in rule["route"] for rule in policy["rules"] if isinstance(rule["route"], dict))
    assert all(Path(corpus.path).is_file() for corpus in config.data.corpora)


def test_what_it_calls_on_a_gpu_exists_here(
    pytestconfig: pytest.Config, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands and torch functions of its GPU path (which cannot run here), in this process:
    `python -m govray` is the CLI's ``main`` (tests/test_cli.py runs it as a process), and `pytest -m
    gpu` needs the marker registered in the configuration this session read."""
    assert callable(torch.cuda.nccl.version) and callable(torch.cuda.get_device_name)
    assert main(["run", "--help"]) == 0
    assert "Usage:" in capsys.readouterr().out
    assert any(line.startswith("gpu:") for line in pytestconfig.getini("markers"))


@pytest.mark.slow  # collects the whole tree: ~16 s
def test_the_files_it_names_hold_every_gpu_test_of_the_tree() -> None:
    """It runs ``pytest -m gpu`` over the files it names (a GPU image may lack what other test
    modules import): those files hold every test the whole tree marks ``gpu``, and some."""

    def collected(*paths: str) -> set[str]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-m",
                "gpu",
                "-p",
                "no:cacheprovider",
                *paths,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return {line for line in done.stdout.splitlines() if "::" in line}

    named = collected(*gpu_test_files())
    assert named and named == collected()
