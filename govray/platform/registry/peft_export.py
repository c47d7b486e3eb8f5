"""An adapter govray trained, handed to the Hugging Face ecosystem: a verified checkpoint's adapter
file rewritten in PEFT's layout, so ``peft.PeftModel.from_pretrained(base, directory)`` loads it.

Only the adapter's tensors and its policy declaration are read; the model's structure (which
targets are Linear, Conv1D or Embedding) comes from the trial's model built on the meta device,
so no full model is built. Example::

    export_peft_adapter(Path("runs/t1/checkpoint_000003"), "records-lora", Path("out"), trust)
    # out/adapter_config.json, out/adapter_model.safetensors
"""

from __future__ import annotations

from pathlib import Path

from govray.core.keys import TrustConfig
from govray.core.storage import open_storage
from govray.governance.adapter_files import read_adapter_factors
from govray.governance.adapters import AdapterError
from govray.governance.peft_format import peft_task_type, write_peft_adapter
from govray.governance.routing import lora_target_kind
from govray.platform.run.plan import code_directory
from govray.train.checkpoints.files import load_checkpoint
from govray.train.reproduce.snapshots import CodeSnapshot, use_recorded_code
from govray.train.runspec import RUN_SPEC_FILE, RunSpec, read_run_spec
from govray.train.trial import importable, make_trial


def export_peft_adapter(directory: Path, adapter: str, out: Path, trust: TrustConfig) -> Path:
    """Write ``adapter`` of the checkpoint at ``directory`` (verified against ``trust`` first) in
    PEFT's layout under ``out``; returns ``out``."""
    load_checkpoint(directory, trust)  # every file against the signed manifest, or refused
    spec = read_run_spec(directory / RUN_SPEC_FILE)
    declared = spec.policy.adapters.get(adapter)
    if declared is None:
        known = ", ".join(spec.policy.adapters) or "none"
        raise AdapterError(
            f"{directory}: the run's policy declares no adapter '{adapter}' (adapters: {known})"
        )
    path = directory / f"adapter-{adapter}.safetensors"
    if not path.is_file():
        raise AdapterError(f"{directory}: holds no file of adapter '{adapter}' (removed from this version?)")
    table = spec.routing
    targets = next(
        (table.adapter_targets[route] for route, name in table.adapter_names.items() if name == adapter), ()
    )
    _import_trial_code(spec)
    model = make_trial(spec.trial, spec.hparams, spec.settings).build_meta_model()
    kinds = {}
    for target in targets:
        kind = lora_target_kind(model.get_submodule(target))
        if kind is None:
            raise AdapterError(f"adapter '{adapter}': target '{target}' is no longer a LoRA-able module")
        kinds[target] = kind
    factors = read_adapter_factors(path, adapter, targets)
    name = getattr(model, "name_or_path", None) or None
    return write_peft_adapter(out, declared, kinds, factors, name, peft_task_type(model))


def _import_trial_code(spec: RunSpec) -> None:
    """The trial's recorded code snapshot (what the run ran, verified), or for a spec without a
    reproducibility record (a tool's) the directory it was planned in."""
    code = spec.reproducibility.get("code")
    if code is None:
        importable(spec.code_dir)
        return
    snapshot = CodeSnapshot.model_validate(code)
    storage = open_storage(spec.storage)
    use_recorded_code(snapshot, code_directory(storage, snapshot), storage)
