"""``govray plan EXPERIMENT``: a rank's peak memory for the run as configured, before it is queued.

The estimator (:mod:`govray.train.footprint.estimate`) runs one governed step of the experiment's trial
on fake tensors with a fake process group of the run's world size. With ``--gpu-memory GIB`` a run
whose peak per rank exceeds it is refused (exit 23), naming the largest parts and the excess.
"""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import ConfigArgument, console, table
from govray.core.errors import ConfigError

GIB = 2**30


def plan(
    experiment: Path = ConfigArgument,
    world: int | None = typer.Option(
        None, "--world", min=1, help="Ranks (default: resources.workers, an elastic run's max)."
    ),
    gpu_memory: float | None = typer.Option(
        None,
        "--gpu-memory",
        min=0.0,
        help="GiB per GPU: refuse (exit 23) a run whose peak per rank exceeds it.",
    ),
) -> None:
    """Print each rank's peak memory (params, grads, optimizer state, activations, governance and
    communication buffers) for one step of the experiment's first trial; refuse a run that cannot fit."""
    from govray.config.experiment import load_experiment
    from govray.governance.policy import load_policy
    from govray.train.footprint.estimate import MemoryPlanError, PlanSetup, plan_governed
    from govray.train.hf import CausalLMTrial
    from govray.train.parallel.strategies import refuse_unplanned
    from govray.train.trial import make_trial

    config = load_experiment(experiment)
    refuse_unplanned(config.resources.strategy, str(experiment))
    hparams = config.default_hparams()
    settings = config.training.with_hyperparameters(hparams)
    trial = make_trial(config.trial, hparams, settings)
    if config.data.packing is not None:
        seq_len = config.data.packing.seq_len
    elif isinstance(trial, CausalLMTrial):
        seq_len = trial.context + 1  # its rows: BOS, then `context` tokens
    else:
        raise ConfigError(f"{experiment}: set data.packing.seq_len, the tokens per row govray plan measures")
    setup = PlanSetup(
        world_size=world or config.resources.max_workers,
        micro_batch=-(-settings.batch_size // settings.accumulation_steps),
        seq_len=seq_len,
        precision=settings.precision,
        # The engine's per-block checkpointing, once the experiment's training section has it.
        activation_checkpointing=bool(getattr(settings, "activation_checkpointing", False)),
    )
    measured = plan_governed(trial, load_policy(config.policy.file), setup)
    shown = table("per rank", "at the peak", "largest in the step")
    for (kind, at_peak), (_, largest) in zip(measured.at_peak.items(), measured.largest.items(), strict=True):
        shown.add_row(kind, _size(at_peak), _size(largest))
    shown.add_row("peak", _size(measured.total), "")
    console.print(
        f"{config.name}: {setup.world_size} rank(s), {setup.micro_batch} row(s) of {setup.seq_len} tokens "
        f"per micro-batch, {setup.precision.value}, activation checkpointing "
        f"{'on' if setup.activation_checkpointing else 'off'}"
    )
    console.print(shown)
    console.print(
        f"peak per rank {_size(measured.total)}; all {setup.world_size} rank(s) "
        f"{_size(measured.total * setup.world_size)}"
    )
    if gpu_memory is not None and measured.total > gpu_memory * GIB:
        parts = sorted(measured.at_peak.items(), key=lambda item: -item[1])[:3]
        listed = ", ".join(f"{kind} {_size(size)}" for kind, size in parts)
        raise MemoryPlanError(
            f"{config.name} does not fit in {gpu_memory:g} GiB per GPU: its peak per rank is "
            f"{_size(measured.total)} ({listed}), {_size(int(measured.total - gpu_memory * GIB))} too much"
        )


def _size(size: int) -> str:
    """Bytes as GiB, or as MiB below one GiB (a tiny example's numbers stay readable)."""
    return f"{size / GIB:.3f} GiB" if size >= GIB else f"{size / 2**20:.3f} MiB"
