"""``jobs.gpu_session`` (the script a lent GPU runs first) and ``jobs.gpu_stage`` (what it carries),
checked where there is no GPU: the FLOP accounting and the peak table its MFU divides by, the
staged packages, the wheel unpacking that keeps Ray's binaries executable, and the whole session on
a tiny model on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jobs.gpu_measures import PEAK_BF16, flops_per_token, matmul_weights, peak_flops
from jobs.gpu_session import LLAMA_1B
from jobs.gpu_stage import IMAGE_PACKAGES, NOT_NEEDED, runtime_closure, unpack

REPO = Path(__file__).resolve().parents[1]


def test_the_peak_is_the_longest_gpu_model_named_in_the_device_name() -> None:
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756.5e12  # not the SXM part's
    assert peak_flops("NVIDIA A10G") == 70e12  # not the A10's
    assert peak_flops("NVIDIA GH200 480GB") == PEAK_BF16["GH200"]
    assert peak_flops("Tesla T4") is None  # not in the table: no MFU rather than a wrong one


def test_flops_per_token_count_every_matmul_once_by_hand() -> None:
    d, mlp, blocks, vocab, kv = 2048, 8192, 16, 128256, 512  # kv: 8 KV heads of 64
    per_block = d * d * 2 + d * kv * 2 + 3 * d * mlp  # q, o; k, v; gate, up, down
    weights = blocks * per_block + vocab * d  # the tied head once; the embedding lookup is no matmul
    assert matmul_weights(LLAMA_1B) == weights
    attention = 12 * blocks * d * 2048
    assert flops_per_token(LLAMA_1B, 2048, frozen_base=False) == 6 * weights + attention
    assert flops_per_token(LLAMA_1B, 2048, frozen_base=True) == 4 * weights + attention


def test_the_staged_closure_is_govrays_runtime_not_its_dev_tools() -> None:
    closure = runtime_closure()
    assert {"ray", "pydantic", "sqlmodel", "cryptography", "tensorboardx"} <= closure
    # Extras are skipped whichever quotes their markers use (fsspec's 'test-downstream' pulls moto).
    assert not {"moto", "mypy", "ruff", "pytest"} & closure
    staged = closure - IMAGE_PACKAGES - NOT_NEEDED
    assert "ray" in staged and "torch" not in staged and "tensorboardx" in staged


def test_unpacking_a_wheel_keeps_executable_bits(tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        binary = zipfile.ZipInfo("demo/core/server")
        binary.external_attr = 0o755 << 16
        archive.writestr(binary, "#!/bin/sh\necho served\n")
        plain = zipfile.ZipInfo("demo/__init__.py")
        plain.external_attr = 0o644 << 16
        archive.writestr(plain, "")
    unpack(wheel, tmp_path / "site")
    assert os.access(tmp_path / "site/demo/core/server", os.X_OK)
    assert not os.access(tmp_path / "site/demo/__init__.py", os.X_OK)
    ran = subprocess.run([tmp_path / "site/demo/core/server"], capture_output=True, text=True, check=True)
    assert ran.stdout == "served\n"


@pytest.mark.slow
def test_the_session_runs_its_phases_on_a_tiny_model_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "GOVRAY_HOME": str(tmp_path / "home")}
    command = [
        sys.executable,
        "-m",
        "jobs.gpu_session",
        str(tmp_path / "out"),
        "--shape",
        "tiny",
        "--pairs",
        "2",
    ]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    session = json.loads((tmp_path / "out/session.json").read_text())
    assert {name: phase["exit"] for name, phase in session["phases"].items()} == {
        "memory": 0,
        "throughput": 0,
        "replay": 0,
    }
    memory = json.loads((tmp_path / "out/memory.json").read_text())["cases"]
    assert set(memory) == {"lora", "full"}
    # The frozen base holds no optimizer state: the LoRA plan's is the adapters' alone.
    assert 0 < memory["lora"]["plan_at_peak"]["optimizer"] < memory["full"]["plan_at_peak"]["optimizer"]
    throughput = json.loads((tmp_path / "out/throughput.json").read_text())["cases"]
    for case in ("lora", "full"):
        timed = throughput[case]
        assert timed["govray"]["median_step_s"] > 0 and timed["plain"]["median_step_s"] > 0
        assert timed["govray/plain throughput (median of per-pair ratios)"] > 0
        assert timed["govray"]["mfu"] is None  # no GPU, no peak: no MFU
    assert json.loads((tmp_path / "out/replay.json").read_text()) == {"skipped": "no CUDA device"}
