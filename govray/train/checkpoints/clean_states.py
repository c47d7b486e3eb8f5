"""Clean states in checkpoints: under a memorization rollback policy, a checkpoint also carries
the last clean state (weights of the governed model, optimizer state) when it is an earlier step,
what a rollback after a resume returns to. Its files are named ``clean-STEP-NAME`` and signed
with the checkpoint's; its ledger is in ``CheckpointState.clean_ledgers``.

Example::

    save_clean_state(directory, step, snapshot.weights, snapshot.optimizer)  # before sealing
    states = load_clean_states(load_checkpoint(directory, trust))           # step → (weights, optimizer)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from govray.core.storage import as_created
from govray.train.checkpoints.files import (
    CheckpointError,
    LoadedCheckpoint,
    optimizer_state_from_files,
    split_optimizer_state,
)


def save_clean_state(
    directory: Path, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Write an earlier clean state (weights of the governed model, optimizer state) beside a
    checkpoint's own files, before ``seal_checkpoint`` signs them all; its ledger goes in
    ``CheckpointState.clean_ledgers``."""
    optimizer_tensors, optimizer_meta = split_optimizer_state(optimizer_state)
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()},
        str(directory / _clean(step, "weights.safetensors")),
    )
    save_file(optimizer_tensors, str(directory / _clean(step, "optimizer.safetensors")))
    for name in ("weights.safetensors", "optimizer.safetensors"):
        as_created(directory / _clean(step, name))  # (safetensors writes 0600)
    (directory / _clean(step, "optimizer.json")).write_text(
        json.dumps(optimizer_meta, indent=1, sort_keys=True)
    )


def load_clean_states(loaded: LoadedCheckpoint) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The clean states a verified checkpoint carries: step → (weights, optimizer state)."""
    states = {}
    for key in loaded.state.clean_ledgers:
        step = int(key)
        try:
            weights = load_file(str(loaded.directory / _clean(step, "weights.safetensors")))
            optimizer_state = optimizer_state_from_files(
                load_file(str(loaded.directory / _clean(step, "optimizer.safetensors"))),
                json.loads((loaded.directory / _clean(step, "optimizer.json")).read_text()),
            )
        except (OSError, SafetensorError, json.JSONDecodeError, ValueError) as error:
            raise CheckpointError(
                f"{loaded.directory}: its clean state of step {step} is unreadable: {error}"
            ) from None
        states[step] = (weights, optimizer_state)
    return states


def clean_name(step: int, name: str) -> str:
    """The name under which a checkpoint carries ``name`` of its earlier clean state at ``step``."""
    return _clean(step, name)


def _clean(step: int, name: str) -> str:
    return f"clean-{step:08d}-{name}"
