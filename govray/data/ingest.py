"""Ingest: read every corpus with Ray Data, validate every row's credential, route and split it,
and write route-partitioned shards.

Pipeline, per corpus: one Ray task per file checks it first (``govray.data.validate``: empty
files, duplicated columns or JSON keys, malformed JSONL lines), because Ray Data's own refusals
name nothing; Ray Data reads the files (order preserved) into Arrow blocks; one Ray task
per block numbers its rows, validates each row's credential, resolves its route with the policy,
hashes it and assigns the holdout split; then one Ray task per route (and per holdout corpus)
writes that partition's parquet files. Nothing is written unless every row of every corpus is
valid, so a refused ingest leaves no partial shards behind.

Example::

    result = ingest(config, verified_policy)       # needs ray.init() (the CLI does it)
    result.manifest.route("public").rows
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
import ray.exceptions

from govray.config.experiment import CorpusRole, CorpusSpec, ExperimentConfig
from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import CredentialError, GovrayError, IngestError, PolicyError
from govray.core.storage import open_storage
from govray.data.fingerprint import corpus_files, fingerprint_files
from govray.data.shards import (
    MANIFEST,
    SHARD_FORMAT_VERSION,
    CorpusSummary,
    RouteSummary,
    ShardFile,
    ShardManifest,
    ShardSet,
)
from govray.data.validate import check_file, diagnose_file, locate
from govray.governance.credentials import build_credential
from govray.governance.policy import DepthPolicy, VerifiedPolicy

ROWS_PER_SHARD_FILE = 100_000
HOLDOUT = "__holdout__"  # the _route value of rows not used for training


@dataclass(frozen=True)
class IngestResult:
    root: Path
    manifest: ShardManifest
    reused: bool  # True when identical shards already existed


def _read(spec: CorpusSpec, files: Sequence[Path]) -> ray.data.Dataset:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # row numbers follow file order
    context.enable_progress_bars = False
    paths = [str(file) for file in files]
    fmt = spec.resolved_format.value
    if fmt == "parquet":
        return ray.data.read_parquet(paths, partitioning=None, file_extensions=None)
    # partitioning=None: no hive-style columns from directory names.
    if fmt == "jsonl":
        return ray.data.read_json(
            paths,
            lines=True,
            partitioning=None,  # type: ignore[arg-type]
            file_extensions=None,
        )
    return ray.data.read_csv(paths, partitioning=None, file_extensions=None)  # type: ignore[arg-type]


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)  # dates, decimals: their canonical string form


def row_hash(row: dict[str, Any]) -> str:
    """sha256 of the row's canonical JSON (source columns only)."""
    return sha256_hex(canonical_json(_json_value(row)))


def in_holdout(digest: str, fraction: float) -> bool:
    """Deterministic split: the first 64 bits of the row hash as a fraction of 2**64."""
    return int(digest[:16], 16) < fraction * 2**64


@ray.remote(num_returns=2)
def _annotate_block(
    block: pa.Table, offset: int, spec_json: str, policy_json: str, holdout_fraction: float
) -> tuple[pa.Table | None, dict[str, Any]]:
    """Number, validate, route, hash and split the rows of one block.

    Returns the annotated block and a summary; on the first bad row, ``(None, {"error": ...,
    "kind": ..., "row": ...})`` (the kind names the error class: a bad credential or a row that
    matches no policy rule; the row is its 0-based number in the corpus, or None).
    """
    spec = CorpusSpec.model_validate_json(spec_json)
    policy = DepthPolicy.model_validate_json(policy_json)
    base = spec.base_credential()
    missing = [column for column in spec.credential_columns.values() if column not in block.column_names]
    if missing:
        return None, {
            "error": f"corpus '{spec.id}': credential column(s) {', '.join(missing)} not in the data "
            f"(its columns: {', '.join(block.column_names)})",
            "kind": "credential",
            "row": None,
        }
    cache: dict[tuple[Any, ...], tuple[str, str]] = {}
    routes, hashes, credentials = [], [], []
    for index, row in enumerate(block.to_pylist()):
        number = offset + index
        overrides = tuple(row[column] for column in spec.credential_columns.values())
        if overrides not in cache:
            for field, column in spec.credential_columns.items():
                if row[column] is None:
                    return None, {
                        "error": f"corpus '{spec.id}' row {number}: credential field '{field}' "
                        f"(column '{column}') is empty",
                        "kind": "credential",
                        "row": number,
                    }
            values = {**base, **{f: row[c] for f, c in spec.credential_columns.items()}}
            try:
                credential = build_credential(values, where=f"corpus '{spec.id}' row {number}")
                route = (
                    policy.route_key_for(credential, where=f" (row {number})")
                    if spec.role == CorpusRole.TRAIN
                    else HOLDOUT
                )
            except (CredentialError, PolicyError) as error:
                kind = "credential" if isinstance(error, CredentialError) else "policy"
                return None, {"error": str(error), "kind": kind, "row": number}
            cache[overrides] = (route, canonical_json(credential.model_dump(mode="json")).decode())
        route, credential_text = cache[overrides]
        digest = row_hash(row)
        if spec.role != CorpusRole.TRAIN or in_holdout(digest, holdout_fraction):
            route = HOLDOUT
        routes.append(route)
        hashes.append(digest)
        credentials.append(credential_text)
    rows = pa.array(range(offset, offset + block.num_rows), type=pa.int64())
    annotated = (
        block.append_column("_corpus", pa.array([spec.id] * block.num_rows, type=pa.string()))
        .append_column("_row", rows)
        .append_column("_row_hash", pa.array(hashes, type=pa.string()))
        .append_column("_route", pa.array(routes, type=pa.string()))
        .append_column("_credential", pa.array(credentials, type=pa.string()))
    )
    counts: dict[str, int] = {}
    for route in routes:
        counts[route] = counts.get(route, 0) + 1
    return annotated, {"error": None, "counts": counts}


@ray.remote
def _num_rows(block: pa.Table) -> int:
    return block.num_rows


@ray.remote
def _check_file(file: str, format_name: str) -> str | None:
    return check_file(Path(file), format_name)


# The error a row's summary names, by its kind: each has its documented exit code.
_ROW_ERRORS: dict[str, type[GovrayError]] = {"credential": CredentialError, "policy": PolicyError}


@ray.remote
def _write_partition(
    route: str, corpus: str | None, directory: str, relative: str, *blocks: pa.Table
) -> list[dict[str, Any]]:
    """Write the rows of ``route`` (optionally of one corpus) from ``blocks``, in order."""
    import pyarrow.compute as pc

    parts = []
    for block in blocks:
        keep = pc.equal(block["_route"], route)
        if corpus is not None:
            keep = pc.and_(keep, pc.equal(block["_corpus"], corpus))
        parts.append(block.filter(keep))
    table = pa.concat_tables(parts, promote_options="permissive").combine_chunks()
    written = []
    Path(directory).mkdir(parents=True, exist_ok=True)
    for number, start in enumerate(range(0, table.num_rows, ROWS_PER_SHARD_FILE)):
        name = f"part-{number:05d}.parquet"
        path = Path(directory) / name
        chunk = table.slice(start, ROWS_PER_SHARD_FILE)
        pq.write_table(chunk, path, compression="zstd", row_group_size=16_384)
        written.append({"path": f"{relative}/{name}", "rows": chunk.num_rows, "sha256": file_sha256(path)})
    return written


@dataclass
class _Corpus:
    spec: CorpusSpec
    relative_files: list[str]
    fingerprint: str
    blocks: list[ray.ObjectRef]
    counts: dict[str, int]
    rows: int


def ingest_key(config: ExperimentConfig, policy: VerifiedPolicy, fingerprints: dict[str, str]) -> str:
    """Digest of everything the shards depend on."""
    return sha256_hex(
        canonical_json(
            {
                "format_version": SHARD_FORMAT_VERSION,
                "policy_digest": policy.digest,
                "holdout_fraction": config.data.holdout_fraction,
                "corpora": [
                    {
                        "spec": spec.model_dump(mode="json", exclude={"path"}),
                        "fingerprint": fingerprints[spec.id],
                    }
                    for spec in config.data.corpora
                ],
            }
        )
    )


def _process_corpus(spec: CorpusSpec, policy_json: str, default_holdout: float) -> _Corpus:
    format_name = spec.resolved_format.value
    files = corpus_files(spec.path, format_name, corpus_id=spec.id)
    paths = [file for _, file in files]
    # Ray Data names nothing when it refuses a file, and accepts some bad ones: check each first.
    problems = ray.get([_check_file.remote(str(file), format_name) for file in paths])
    if problem := next((problem for problem in problems if problem), None):
        raise IngestError(f"corpus '{spec.id}': {problem}")
    fingerprint = fingerprint_files(files)
    try:
        blocks = _read(spec, paths).to_arrow_refs()
    except Exception as error:  # Ray Data wraps reader errors: say which file failed, and where
        raise IngestError(f"corpus '{spec.id}': {_read_failure(paths, format_name, error)}") from None
    sizes = ray.get([_num_rows.remote(block) for block in blocks])
    if sum(sizes) == 0:
        raise IngestError(f"corpus '{spec.id}' ({spec.path}) is empty: it has no rows")
    holdout = spec.holdout_fraction if spec.holdout_fraction is not None else default_holdout
    spec_json = spec.model_dump_json()
    annotated: list[ray.ObjectRef] = []
    summaries: list[ray.ObjectRef] = []
    offset = 0
    for block, size in zip(blocks, sizes, strict=True):
        refs: Any = _annotate_block.remote(block, offset, spec_json, policy_json, holdout)  # num_returns=2
        annotated.append(refs[0])
        summaries.append(refs[1])
        offset += size
    counts: dict[str, int] = {}
    for summary in ray.get(summaries):  # in row order: the first error is the first bad row
        if summary["error"]:
            raise _row_error(summary, paths, format_name)
        for route, count in summary["counts"].items():
            counts[route] = counts.get(route, 0) + count
    return _Corpus(spec, [relative for relative, _ in files], fingerprint, annotated, counts, sum(sizes))


def _row_error(summary: dict[str, Any], files: list[Path], format_name: str) -> GovrayError:
    """The error of a block's first bad row, with the file, row and line it sits at."""
    message = summary["error"]
    if summary["row"] is not None and (where := locate(files, format_name, summary["row"])):
        message += f" (at {where})"
    return _ROW_ERRORS.get(summary["kind"], IngestError)(message)


def _read_failure(files: list[Path], format_name: str, error: BaseException) -> str:
    """What went wrong when Ray Data could not read a corpus: the first file that fails alone."""
    for file in files:
        if problem := diagnose_file(file, format_name):
            return problem
    return f"cannot read {', '.join(str(file) for file in files)}: {_root_cause(error)}"


def _root_cause(error: BaseException) -> str:
    """The innermost error with a message, without Ray's task wrapper and traceback."""
    found = error
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if str(current).strip() and not isinstance(current, ray.exceptions.RayTaskError):
            found = current
        inner = getattr(current, "cause", None) if isinstance(current, ray.exceptions.RayTaskError) else None
        current = inner if isinstance(inner, BaseException) else current.__cause__
    text = str(found).strip().splitlines()
    return f"{type(found).__name__}: {text[-1] if text else ''}"


def ingest(config: ExperimentConfig, policy: VerifiedPolicy, *, force: bool = False) -> IngestResult:
    """Validate and shard every corpus of ``config`` under ``STORAGE/shards/KEY``.

    Raises ``IngestError`` naming the corpus, and the file, row and column at fault
    (``CredentialError`` for a row's bad credential, ``PolicyError`` for a row that matches no
    rule); writes nothing then. Rows count from 0, lines from 1 (``govray.data.validate``).
    """
    storage = open_storage(config.storage_path)
    storage.check()  # unreachable object storage is refused before any corpus is read
    policy_json = policy.policy.model_dump_json()
    corpora = [
        _process_corpus(spec, policy_json, config.data.holdout_fraction) for spec in config.data.corpora
    ]
    key = ingest_key(config, policy, {c.spec.id: c.fingerprint for c in corpora})
    root = storage.root / "shards" / key
    fetched = storage.fetch(root, verify=lambda staged: ShardSet.open(staged, verify=True))
    if fetched and (root / MANIFEST).exists() and not force:
        existing = ShardSet.open(root, verify=True)
        return IngestResult(root=root, manifest=existing.manifest, reused=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=root.parent))
    try:
        manifest = _write_shards(config, policy, corpora, key, staging)
        (staging / MANIFEST).write_text(manifest.to_json())
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)  # atomic: readers see complete shards or none
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    storage.upload(root)  # the manifest last: other nodes see complete shards or none
    return IngestResult(root=root, manifest=manifest, reused=False)


def _write_shards(
    config: ExperimentConfig,
    policy: VerifiedPolicy,
    corpora: list[_Corpus],
    key: str,
    staging: Path,
) -> ShardManifest:
    all_blocks = [block for corpus in corpora for block in corpus.blocks]
    route_keys = list(policy.policy.routes())
    route_jobs = {
        route: _write_partition.remote(
            route, None, str(staging / "train" / route), f"train/{route}", *all_blocks
        )
        for route in route_keys
        if any(corpus.counts.get(route) for corpus in corpora)
    }
    holdout_jobs = {
        corpus.spec.id: _write_partition.remote(
            HOLDOUT,
            corpus.spec.id,
            str(staging / "holdout" / corpus.spec.id),
            f"holdout/{corpus.spec.id}",
            *corpus.blocks,
        )
        for corpus in corpora
        if corpus.counts.get(HOLDOUT)
    }
    try:
        route_files = dict(zip(route_jobs, ray.get(list(route_jobs.values())), strict=True))
        holdout_files = dict(zip(holdout_jobs, ray.get(list(holdout_jobs.values())), strict=True))
    except ray.exceptions.RayTaskError as error:
        raise IngestError(f"writing shards failed: {_root_cause(error)}") from None
    routes = [
        RouteSummary(
            route=route,
            rows=sum(corpus.counts.get(route, 0) for corpus in corpora),
            corpus_counts={c.spec.id: c.counts[route] for c in corpora if c.counts.get(route)},
            files=[ShardFile(**entry) for entry in route_files.get(route, [])],
        )
        for route in route_keys
    ]
    summaries = [
        CorpusSummary(
            corpus_id=corpus.spec.id,
            role=corpus.spec.role.value,
            format=corpus.spec.resolved_format.value,
            fingerprint=corpus.fingerprint,
            files=corpus.relative_files,
            rows=corpus.rows,
            train_rows=corpus.rows - corpus.counts.get(HOLDOUT, 0),
            holdout_rows=corpus.counts.get(HOLDOUT, 0),
            route_counts={route: count for route, count in corpus.counts.items() if route != HOLDOUT},
            credential=corpus.spec.base_credential(),
            credential_columns=corpus.spec.credential_columns,
        )
        for corpus in corpora
    ]
    return ShardManifest(
        key=key,
        policy_name=policy.policy.name,
        policy_version=policy.policy.version,
        policy_digest=policy.digest,
        holdout_fraction=config.data.holdout_fraction,
        corpora=summaries,
        routes=routes,
        holdout={cid: [ShardFile(**entry) for entry in files] for cid, files in holdout_files.items()},
    )
