"""The one script to run first whenever a GPU is lent: ``python -m jobs.gpu_session OUT``.

Three phases, each in its own process under its own deadline (a phase that hangs is killed and
recorded as timed out; the next one still runs), each writing ``OUT/PHASE.json``; ``OUT/session.json``
holds the machine, the versions and how each phase ended. The model is a Llama-3.2-1B shape
(hidden 2048, 16 blocks, 32 heads, 8 KV heads, MLP 8192, vocab 128256, tied embeddings; random
init from its config, nothing downloaded) on the ``hf_lm`` example's three corpora packed into
windows of 2048 tokens, bf16 autocast, activation checkpointing, one rank, two governed cases:

- ``lora``: every corpus routed to its own LoRA adapter (rank 16 on q/k/v/o; licensed text on the
  upper half of the blocks only), the base frozen;
- ``full``: the example's signed policy (public text trains every tensor, licensed text the upper
  blocks, PII a removable adapter): a full fine-tune.

1. ``memory`` (first): ``govray plan``'s figure (``plan_governed``, as the CLI calls it, and again
   with the frozen tensors in fp32, which is what the engine holds today) against
   ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over three real governed steps.
2. ``throughput``: govray's governed step against an independent Hugging Face + PEFT loop
   (``jobs.gpu_measures.PlainLoop``: ``AutoModelForCausalLM.from_config``, PEFT's
   ``get_peft_model`` for the LoRA case, ``gradient_checkpointing_enable``, the model's own loss,
   AdamW, clipping) on the same windows, timed with CUDA events, one step of each in turn with the
   order flipping every pair. Tokens/s per GPU and MFU against the peak dense bf16 FLOP/s of the
   GPU model (``jobs.gpu_measures``: its table and PaLM's FLOP accounting).
3. ``replay``: removal = replay bit for bit in deterministic mode on the GPU
   (``tests/test_gpu.py``'s deterministic test, through pytest).

Options: ``--phase NAME`` (run one phase in this process), ``--shape tiny`` (a 2-block model on
short windows: a check of this script itself, on the CPU too, where ``memory`` records only the
plan), ``--pairs N`` (timed pairs per case). Staging the packages the GPU machine lacks:
``python -m jobs.gpu_stage``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from jobs.gpu_measures import PROJECTIONS, PlainLoop, flops_per_token, peak_flops, timer

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
LLAMA_1B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
TINY: dict[str, Any] = {
    **LLAMA_1B,
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
SMALL: dict[str, Any] = {
    **LLAMA_1B,
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
# config, window, rows per step. "small" is the CPU's stand-in (a real vocabulary, short windows);
# "tiny" checks this script itself.
SHAPES = {"llama-1b": (LLAMA_1B, 2048, 8), "small": (SMALL, 512, 4), "tiny": (TINY, 128, 4)}
# Deadlines, seconds. On an H200 (2026-11-28) the phases took about 175, 240 (10 and 6 pairs a
# case) and 67 s, most of it building the 1B model twice a phase on the host.
PHASES: dict[str, int] = {"memory": 190, "throughput": 270, "replay": 90}
WARMUP = 3
CASES = ("lora", "full")


def lora_policy(blocks: int) -> dict[str, Any]:
    """Every corpus to its own adapter; licensed text only on the upper half of the blocks."""
    every = [f"model.layers.*.self_attn.{projection}" for projection in PROJECTIONS]
    upper = [
        f"model.layers.{block}.self_attn.{p}" for block in range(blocks // 2, blocks) for p in PROJECTIONS
    ]
    adapter = {"kind": "lora", "rank": 16, "alpha": 32}
    return {
        "name": "gpu-session-lora",
        "version": 1,
        "adapters": {
            "records-lora": {**adapter, "targets": every},
            "licensed-lora": {**adapter, "targets": upper},
            "public-lora": {**adapter, "targets": every},
        },
        "rules": [
            {
                "name": "pii",
                "match": {"sensitivity": ["pii", "special-category"]},
                "route": {"adapter": "records-lora"},
            },
            {
                "name": "licensed",
                "match": {"license_class": "licensed"},
                "route": {"adapter": "licensed-lora"},
            },
            {"name": "public", "route": {"adapter": "public-lora"}},
        ],
    }


def experiment(root: Path, case: str, shape_name: str) -> Path:
    """The hf_lm example under ``root`` with this session's model, windows and (``lora``) a
    policy signed by a key made here, trusted by a trust file written beside it."""
    from govray.core.keys import KeyRole, SigningKey, TrustConfig, save_trust
    from govray.governance.policy import sign_policy
    from jobs.examples.digits.golden import save_experiment
    from jobs.examples.hf_lm.golden import example_under

    shape, window, rows = SHAPES[shape_name]
    path = example_under(
        root, steps=1000, precision="bf16", activation_checkpointing=True, batch_size=rows, loss_chunk=1024
    )
    raw = yaml.safe_load(path.read_text())
    raw["hyperparameters"] = {"context": window - 1, "model": shape}
    raw["data"]["packing"] = {"seq_len": window}
    if case == "lora":
        authority = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
        policy = root / "lora.policy.yaml"
        policy.write_text(yaml.safe_dump(lora_policy(shape["num_hidden_layers"]), sort_keys=False))
        policy.with_name(policy.name + ".sig").write_text(sign_policy(policy, authority).to_json())
        trust = TrustConfig()
        trust.add(authority.public_key)
        save_trust(trust, root / "trust.yaml")
        raw["policy"] = {"file": str(policy), "trust": str(root / "trust.yaml")}
    return save_experiment(root, raw)


def governed_run(root: Path, case: str, shape_name: str, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """The experiment's first trial as a worker builds it: ``(config, spec, trial, policy)``."""
    from govray.config.training import Precision
    from govray.core.runtime import ensure_ray
    from govray.governance.policy import load_policy
    from govray.platform.run.plan import plan_run
    from jobs.examples.digits.golden import opened

    ensure_ray()
    config, _, checked, _, ingested = opened(experiment(root, case, shape_name))
    plan = plan_run(config, checked, ingested.root)
    spec, trial = plan.named(f"gpu-{case}", {}), plan.trial
    use_gpu = device.type == "cuda"
    precision = Precision.BF16 if use_gpu else Precision.FP32
    settings = trial.settings.model_copy(update={"precision": precision})
    spec = spec.model_copy(update={"use_gpu": use_gpu, "settings": settings})
    return config, spec, type(trial)(spec.hparams, settings), load_policy(config.policy.file)


def governed_step(spec: Any, trial: Any) -> Any:
    from govray.train.context import WorkerContext
    from govray.train.parallel.worker import Worker
    from govray.train.step.governed import GovernedStep

    return GovernedStep(WorkerContext.of(spec, Worker.detect(spec.use_gpu)), trial)


def memory_case(root: Path, case: str, shape_name: str, device: torch.device) -> dict[str, Any]:
    """The plan's peak and the measured one, for one case."""
    from govray.config.training import Precision
    from govray.train.footprint.estimate import PlanSetup, plan_governed

    _, window, rows = SHAPES[shape_name]
    _, spec, trial, policy = governed_run(root, case, shape_name, device)
    precision = Precision.BF16 if device.type == "cuda" else Precision.FP32
    setup = PlanSetup(
        world_size=1, micro_batch=rows, seq_len=window, precision=precision, activation_checkpointing=True
    )
    started = time.perf_counter()
    planned = plan_governed(trial, policy, setup)
    plan_seconds = time.perf_counter() - started
    planned_fp32 = plan_governed(trial, policy, setup, frozen_dtype=torch.float32)
    result: dict[str, Any] = {
        "case": case,
        "plan_bytes": planned.total,
        "plan_at_peak": dict(planned.at_peak.items()),
        "plan_frozen_fp32_bytes": planned_fp32.total,
        "plan_seconds": round(plan_seconds, 2),
    }
    if device.type != "cuda":
        return {**result, "measured": "no CUDA device: the plan only"}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    governed = governed_step(spec, trial)
    built = torch.cuda.memory_allocated() - before
    for step in range(WARMUP):
        governed.step(step)
    torch.cuda.synchronize()
    governed.governor.check_finite()
    allocated = torch.cuda.max_memory_allocated() - before
    frozen = {str(p.dtype) for p in governed.model.parameters() if not p.requires_grad}
    return {
        **result,
        "built_bytes": built,
        "max_memory_allocated": allocated,
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "frozen_dtypes": sorted(frozen),
        "plan / measured allocated": round(planned.total / allocated, 3),
        "plan (frozen fp32) / measured allocated": round(planned_fp32.total / allocated, 3),
    }


def throughput_case(
    root: Path, case: str, shape_name: str, device: torch.device, pairs: int
) -> dict[str, Any]:
    from govray.data.slots import slot

    shape, window, rows = SHAPES[shape_name]
    _, spec, trial, _ = governed_run(root, case, shape_name, device)
    governed = governed_step(spec, trial)
    plain = PlainLoop(shape, case == "lora", trial.settings.optimizer.lr, device, device.type == "cuda")
    steps = WARMUP + pairs
    windows = [governed.rows.take(slot(governed.schedule, step, 0)) for step in range(steps)]
    tokens = [sum(windows[step]["tokens"].to_pylist()) for step in range(steps)]
    timed = timer(device)
    for step in range(WARMUP):
        governed.step(step)
        plain.step(windows[step])
    times: dict[str, list[float]] = {"govray": [], "plain": []}
    for step in range(WARMUP, steps):  # the order flips every pair (caches, allocator, clocks)
        order = ("govray", "plain") if step % 2 else ("plain", "govray")
        for name in order:
            run = (
                (lambda s=step: governed.step(s))
                if name == "govray"
                else (lambda s=step: plain.step(windows[s]))
            )
            times[name].append(timed(run))
    governed.governor.check_finite()
    per_token = flops_per_token(shape, window, frozen_base=case == "lora")
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    positions = rows * window
    result: dict[str, Any] = {"case": case, "pairs": pairs, "positions_per_step": positions,
                              "real_tokens_per_step": statistics.median(tokens[WARMUP:]),
                              "flops_per_token": per_token, "peak_bf16_flops": peak}  # fmt: skip
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rate = positions / median
        result[name] = {
            "median_step_s": round(median, 5),
            "min_step_s": round(min(seconds), 5),
            "tokens_per_s_per_gpu": round(rate, 1),
            "mfu": round(rate * per_token / peak, 4) if peak else None,
        }
    ratios = [
        plain_time / govray_time
        for plain_time, govray_time in zip(times["plain"], times["govray"], strict=True)
    ]
    result["govray/plain throughput (median of per-pair ratios)"] = round(statistics.median(ratios), 3)
    return result


def run_phase(
    name: str, shape_name: str, pairs: int, out: Path, only: list[str] | None = None
) -> dict[str, Any]:
    """One phase in this process; ``OUT/NAME.json`` is rewritten after each case (a phase killed
    at its deadline keeps the cases it finished)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "replay":
        if device.type != "cuda":
            return {"skipped": "no CUDA device"}
        command = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-k", "deterministic",
                   "-q", "-o", "addopts=", "-p", "no:cacheprovider"]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
        return {"command": " ".join(command[1:]), "exit_code": done.returncode,
                "tail": (done.stdout + done.stderr).splitlines()[-15:]}  # fmt: skip
    cases = {}
    for case in only or CASES:
        with tempfile.TemporaryDirectory(prefix=f"govray-gpu-{name}-{case}-") as root:
            started = time.perf_counter()
            if name == "memory":
                cases[case] = memory_case(Path(root), case, shape_name, device)
            else:
                cases[case] = throughput_case(Path(root), case, shape_name, device, pairs)
            cases[case]["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps(cases[case]), flush=True)
        partial = {"device": str(device), "shape": shape_name, "cases": cases, "complete": False}
        (out / f"{name}.json").write_text(json.dumps(partial, indent=2))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": str(device), "shape": shape_name, "cases": cases, "complete": True}


def machine() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cuda": torch.version.cuda, "cpus": os.cpu_count()}  # fmt: skip
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        facts["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    for package in ("transformers", "peft", "ray", "numpy", "pyarrow"):
        try:
            facts[package] = __import__(package).__version__
        except ImportError as error:
            facts[package] = f"missing: {error}"
    return facts


def session(out: Path, shape_name: str, pairs: int, phases: list[str], cases: list[str] | None = None) -> int:
    """Every phase in its own process under its deadline; ``session.json`` says how each ended."""
    from govray.core.key_creation import init_platform_keys
    from govray.core.keys import platform_public_key

    out.mkdir(parents=True, exist_ok=True)
    if platform_public_key() is None:  # a fresh GOVRAY_HOME (the device's): `govray keys init`
        init_platform_keys()
    summary: dict[str, Any] = {"machine": machine(), "phases": {}}
    print(json.dumps(summary["machine"]), flush=True)
    for name in phases:
        deadline = PHASES[name]
        command = [sys.executable, "-m", "jobs.gpu_session", str(out), "--phase", name, "--shape", shape_name,
                   "--pairs", str(pairs), "--child", *(f"--case={case}" for case in cases or [])]  # fmt: skip
        started = time.perf_counter()
        child = subprocess.Popen(command, cwd=REPO, start_new_session=True)
        try:
            code: int | str = child.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            # Its Ray goes with its process group (never a machine-wide `ray stop`: that ends
            # every Ray driver here, a test session sharing one Ray instance among them).
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = f"timed out after {deadline} s"
        summary["phases"][name] = {"exit": code, "seconds": round(time.perf_counter() - started, 1)}
        print(f"== {name}: {summary['phases'][name]}", flush=True)
        (out / "session.json").write_text(json.dumps(summary, indent=2))
    return 0 if all(phase["exit"] == 0 for phase in summary["phases"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.gpu_session", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for the JSON results")
    parser.add_argument("--phase", choices=list(PHASES), action="append", help="only these (repeatable)")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    parser.add_argument("--pairs", type=int, default=5, help="timed pairs per case")
    parser.add_argument("--case", choices=CASES, action="append", help="only these cases (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one phase, here
    args = parser.parse_args(argv)
    if args.child:
        (name,) = args.phase
        try:
            result = run_phase(name, args.shape, args.pairs, args.out, args.case)
        except Exception as error:  # recorded beside the cases done, then the exit code says it
            written = args.out / f"{name}.json"
            result = json.loads(written.read_text()) if written.exists() else {}
            written.write_text(json.dumps({**result, "error": f"{type(error).__name__}: {error}"}, indent=2))
            raise
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
        return 0
    return session(args.out, args.shape, args.pairs, args.phase or list(PHASES), args.case)


if __name__ == "__main__":
    sys.exit(main())
