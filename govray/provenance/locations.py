"""Where a checkpoint's run spec and attestations live, read without loading the training stack:
the registry's read side and the CLI's store-only commands use these, as does the code that writes
the files (:mod:`govray.provenance.attest`)."""

from __future__ import annotations

from pathlib import Path

from govray.core.errors import AttestationError
from govray.core.keys import TrustConfig
from govray.provenance.model_signature import SIGNATURE_SUFFIX
from govray.train.checkpoints.manifest import listed_bytes, recorded_file, signed_manifest
from govray.train.runspec import RUN_SPEC_FILE, RunSpec, parse_run_spec, read_run_spec


def run_spec_of(checkpoint: Path) -> RunSpec:
    """The spec of the run that wrote ``checkpoint``: its signed copy (``run.json``), which every
    checkpoint holds."""
    path = checkpoint / RUN_SPEC_FILE
    if not path.is_file():
        raise AttestationError(f"{checkpoint}: no {RUN_SPEC_FILE} (not a checkpoint of a govray run?)")
    return read_run_spec(path)


def signed_run_spec(checkpoint: Path, trust: TrustConfig) -> RunSpec:
    """The run spec of ``checkpoint`` as its signed manifest lists it (``CheckpointError`` when
    the signature or the file's digest does not check out): what a reader outside the run (the
    lineage app) takes a run's routing and policy from."""
    manifest, _ = signed_manifest(checkpoint, trust)
    return parse_run_spec(listed_bytes(checkpoint, manifest, RUN_SPEC_FILE), checkpoint / RUN_SPEC_FILE)


def recorded_run_spec(checkpoint: Path, manifest_digest: str, trust: TrustConfig | None = None) -> RunSpec:
    """The run spec of a recorded checkpoint, checked against the manifest the tracking store
    recorded when it was sealed (with ``trust``, its signature too)."""
    content = recorded_file(checkpoint, RUN_SPEC_FILE, manifest_digest, trust)
    return parse_run_spec(content, checkpoint / RUN_SPEC_FILE)


def attestation_prefix(checkpoint: Path, spec: RunSpec) -> Path:
    """``STORAGE/attestations/RUN/CHECKPOINT``, for a run's own checkpoints and for the copies Ray
    Tune keeps elsewhere of a search trial's: the prefix of its attestations' file names."""
    if spec.run_dir and spec.run_name:
        return Path(spec.run_dir).parent.parent / "attestations" / spec.run_name / checkpoint.name
    run = checkpoint.resolve().parent
    return run.parent.parent / "attestations" / run.name / checkpoint.name


def signature_path(destination: Path) -> Path:
    """Where the OpenSSF model signature of the attestations at ``destination`` goes."""
    return destination.with_name(f"{destination.name}.{SIGNATURE_SUFFIX}")
