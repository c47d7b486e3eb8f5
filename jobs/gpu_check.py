"""The first thing to run on a machine with a GPU: ``python -m jobs.gpu_check``.

On a machine with a CUDA GPU it runs, from the repository root, and prints what ran and how it
ended:

1. the GPU tests: ``python -m pytest -m gpu FILES`` over the test files that mark any test ``gpu``
   (the engine on one GPU in bf16, the comm hook's device path, every collective of a governed run
   on the GPU, deterministic replay): named, so that a GPU image without the dev extras some other
   test modules import still runs them;
2. a governed run on one Ray Train worker with ``use_gpu`` — a real NCCL process group, which
   takes CUDA tensors only, even at world size 1 — of the Hugging Face example
   (``jobs/examples/hf_lm``: a tiny Llama, its PII corpus routed to a removable LoRA adapter) in
   bf16, through ``govray run``.

Its exit code is 0 when both passed, 1 otherwise. On a machine without a CUDA GPU it prints one
line saying so and exits 0: there is nothing to check there (the CPU tests cover the rest).

Options: ``--steps N`` (the run's length, default 20), ``--no-tests`` (the run only).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from jobs.examples.digits.golden import save_experiment
from jobs.examples.hf_lm.golden import example_under

REPO = Path(__file__).resolve().parents[1]
TAIL = 15  # lines of each command's output shown when it passed
TAIL_FAILED = 150  # and when it failed


def no_gpu_line() -> str:
    """What a machine without a CUDA GPU prints (the only thing it does)."""
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    return (
        f"gpu_check: no CUDA GPU on this machine (torch {torch.__version__}, built with {built}): nothing ran"
    )


def gpu_experiment(root: Path, steps: int, **training: Any) -> Path:
    """The HF example under ``root``: one Ray Train worker with ``use_gpu`` (NCCL), bf16,
    ``steps`` steps with a validation and a checkpoint halfway and at the end; ``training``
    settings added (``deterministic``, say)."""
    path = example_under(root, steps, precision="bf16", **training)
    raw = yaml.safe_load(path.read_text())
    raw["resources"] = {**raw.get("resources", {}), "workers": 1, "use_gpu": True}
    return save_experiment(root, raw)


def gpu_test_files() -> list[str]:
    """The test files (relative to the repository) that mark any test ``gpu``."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in path.read_text()
    )


def machine() -> str:
    """The GPUs, torch, CUDA and NCCL versions, one line."""
    gpus = ", ".join(torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count()))
    nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    return f"{gpus}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"


def _run(title: str, command: list[str]) -> bool:
    """Run ``command`` from the repository root; print it, its output's last lines and its end."""
    print(f"\n== {title}\n$ {' '.join(command)}", flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    lines = (done.stdout + done.stderr).rstrip().splitlines()
    for line in lines[-(TAIL if done.returncode == 0 else TAIL_FAILED) :]:
        print(f"  {line}")
    print(f"-> {'passed' if done.returncode == 0 else f'FAILED (exit code {done.returncode})'}", flush=True)
    return done.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of the governed GPU run")
    parser.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(no_gpu_line())
        return 0
    print(f"gpu_check on {machine()}")
    results: dict[str, bool] = {}
    if not args.no_tests:
        results["pytest -m gpu"] = _run(
            "the GPU tests",
            [sys.executable, "-m", "pytest", "-m", "gpu", *gpu_test_files(), "-q", "-p", "no:cacheprovider"],
        )
    with tempfile.TemporaryDirectory(prefix="govray-gpu-check-") as root:
        experiment = gpu_experiment(Path(root), args.steps)
        results["govray run (1 GPU worker, NCCL, bf16, LoRA)"] = _run(
            f"the HF example on one Ray Train GPU worker (NCCL), bf16, LoRA route, {args.steps} steps",
            [sys.executable, "-m", "govray", "run", str(experiment)],
        )
    print("\ngpu_check:")
    for name, passed in results.items():
        print(f"  {'passed' if passed else 'FAILED'}  {name}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
