"""The frozen base by reference: a run whose base never trains writes it once, not per checkpoint.

While no base parameter of a run requires a gradient (a LoRA-only run: ``freeze_unroutable``
froze every base tensor), the base model does not change from the first checkpoint to the last.
``FrozenBase`` then writes it once, into the run's base store (``RUN_DIR/base/SHA256.safetensors``,
content-addressed), and every checkpoint the run writes in its run directory refers to that file
by its sha256 in the signed manifest (``Manifest.referenced``) instead of holding a copy: no base
bytes are written or hashed again. Should the base's buffers change (running statistics of a
frozen model in training mode), or the file disappear, the next checkpoint writes a new one.

A checkpoint is made to stand alone again with ``materialize_base`` (the base file hard-linked
into its folder, where verification reads it first): what a registered version and a checkpoint
handed to Tune need. Checkpoint GC deletes a run's base files only once no checkpoint folder of
the run refers to them (``release_unreferenced``). Example::

    frozen = FrozenBase(spec.run_dir, storage)
    referenced = frozen.save(model, directory)         # {} or {"model.safetensors": sha256}
    seal_checkpoint(directory, optimizer_state, state, signer, referenced=referenced)
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from pydantic import ValidationError

from govray.core.storage import IN_PLACE, Storage
from govray.governance.adapter_files import save_base
from govray.governance.adapters import GovernedModel
from govray.train.checkpoints.files import (
    BASE_STORE,
    MANIFEST_FILE,
    MODEL_FILE,
    Manifest,
    base_store_file,
    model_file,
)
from govray.train.checkpoints.folders import checkpoint_directories


class FrozenBase:
    """Where one run's checkpoints keep its base model: the base store while the base is frozen
    and the checkpoint folder lies in the run directory, else ``model.safetensors`` in each folder
    (a run that trains the base; a Tune trial's folders, which Tune copies elsewhere)."""

    def __init__(self, run_dir: str, storage: Storage = IN_PLACE) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        self.storage = storage
        self.digest: str | None = None  # the base file this run's checkpoints refer to
        self._buffers: dict[str, torch.Tensor] = {}  # the base's buffers when it was written

    def save(self, model: GovernedModel, directory: Path) -> dict[str, str]:
        """The base of ``model`` for the checkpoint being written in ``directory``; returns what
        the checkpoint refers to (``{MODEL_FILE: sha256}``), or nothing when it wrote its own."""
        if self.run_dir is None or directory.parent != self.run_dir or not frozen(model):
            save_base(model, directory / MODEL_FILE)
            return {}
        if self.digest is None or not self._unchanged(model) or not self._file().is_file():
            self._write(model)
        assert self.digest is not None
        return {MODEL_FILE: self.digest}

    def resumed(self, directory: Path, model: GovernedModel) -> None:
        """After ``model`` was loaded from a verified checkpoint of this run that refers to a
        base file: later checkpoints refer to the same file (nothing is written again)."""
        if self.run_dir is None or directory.parent != self.run_dir or not frozen(model):
            return
        manifest = Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
        if MODEL_FILE in (manifest.referenced or ()):
            self.digest = manifest.files[MODEL_FILE]
            self._buffers = _copied(buffers(model))

    def _file(self) -> Path:
        assert self.run_dir is not None and self.digest is not None
        return base_store_file(self.run_dir, self.digest)

    def _unchanged(self, model: GovernedModel) -> bool:
        now = buffers(model)
        return now.keys() == self._buffers.keys() and all(
            torch.equal(tensor.cpu(), self._buffers[name]) for name, tensor in now.items()
        )

    def _write(self, model: GovernedModel) -> None:
        assert self.run_dir is not None
        store = self.run_dir / BASE_STORE
        store.mkdir(parents=True, exist_ok=True)
        staged = store / f".{uuid.uuid4().hex}.safetensors"  # hidden: never taken for a base file
        try:
            digest = save_base(model, staged)
            os.replace(staged, base_store_file(self.run_dir, digest))
        finally:
            staged.unlink(missing_ok=True)
        self.digest, self._buffers = digest, _copied(buffers(model))
        self.storage.upload(self._file())  # before any checkpoint that refers to it


def frozen(model: GovernedModel) -> bool:
    """Whether no base parameter of ``model`` can change: none requires a gradient."""
    return not any(parameter.requires_grad for _, parameter in model.base_named_parameters())


def buffers(model: GovernedModel) -> dict[str, torch.Tensor]:
    """The base state that is no parameter (buffers, which may change while nothing trains)."""
    parameters = {parameter.data_ptr() for _, parameter in model.base_named_parameters()}
    return {
        name: tensor for name, tensor in model.base_state().items() if tensor.data_ptr() not in parameters
    }


def _copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def materialize_base(directory: Path, storage: Storage = IN_PLACE) -> Path:
    """Make a checkpoint folder that refers to its run's base file stand alone: the file
    hard-linked (or copied) into it as ``model.safetensors`` (its manifest, signature and digests
    unchanged: verification reads the folder's own copy first and checks it against the signed
    sha256). Returns the folder's model file; a folder that holds its own is left as it is."""
    own, source = directory / MODEL_FILE, model_file(directory)
    if source != own and source.is_file():
        link_or_copy(source, own)
        storage.upload(own)
    return own


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` the same file as ``source``: a hard link (no copy) where the filesystem allows."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def referenced_digests(run_dir: Path, storage: Storage = IN_PLACE) -> set[str] | None:
    """The sha256 of every base file a checkpoint folder of the run refers to; None when a folder
    has no readable manifest (one being written may be about to refer to any of them)."""
    digests: set[str] = set()
    for directory in checkpoint_directories(run_dir, storage):
        try:
            storage.fetch(directory / MANIFEST_FILE)
            manifest = Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
        except (OSError, ValidationError):
            return None
        digests |= {manifest.files[name] for name in manifest.referenced or ()}
    return digests


def release_unreferenced(run_dir: Path, storage: Storage = IN_PLACE) -> list[Path]:
    """Delete the run's base files that no checkpoint folder of the run refers to any more (from
    the object storage too); returns them. Nothing is deleted while a folder of the run has no
    readable manifest. Checkpoint GC calls it after deleting checkpoints."""
    store = run_dir / BASE_STORE
    names = {path.name for path in store.glob("*.safetensors")} if store.is_dir() else set()
    names |= set(storage.list_files(store))
    names = {name for name in names if not name.startswith(".")}  # (hidden: one being written)
    kept = referenced_digests(run_dir, storage) if names else None
    if kept is None:
        return []
    released = [store / name for name in sorted(names) if name.removesuffix(".safetensors") not in kept]
    for path in released:
        storage.delete_file(path)
    return released
