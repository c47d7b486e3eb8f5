"""Ingest: read every corpus with Ray Data, validate every row's credential, route and split it,
and write route-partitioned shards.

Pipeline, per corpus: one Ray task per file checks it first (``govray.data.validate``: empty
files, duplicated columns or JSON keys, malformed JSONL lines), because Ray Data's own refusals
name nothing; one Ray task fingerprints the corpus (a single sha256 stream over its files, so
corpora hash in parallel, each while its rows are processed); Ray Data reads the files (order
preserved) into Arrow blocks; then one Ray task per unit of ``ROWS_PER_UNIT`` consecutive rows
(``govray.data.units``; blocks that straddle units are cut by one task per block) numbers its
rows, validates each row's credential, resolves its route with the policy, hashes it
(``govray.data.rowhash``: new ingests use version 2, recorded in the manifest), assigns
the holdout split and writes the unit's files into a staging directory. No task holds more than
one block or one unit, and the files do not depend on how Ray Data cut the blocks. Only when
every row of every corpus is valid does the staging directory become ``STORAGE/shards/KEY``;
after a refusal the unit tasks are stopped and the staging directory deleted, so a refused
ingest leaves nothing behind.

Example::

    result = ingest(config, verified_policy)       # needs ray.init() (the CLI does it)
    result.manifest.route("public").rows
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
import ray.exceptions
from ray.data._internal.util import unify_schemas_with_validation

from govray.config.data import CorpusSpec
from govray.config.experiment import ExperimentConfig
from govray.core.canonical import canonical_json, sha256_hex
from govray.core.errors import CredentialError, GovrayError, IngestError, PolicyError
from govray.core.runtime import stop_tasks
from govray.core.storage import open_storage, shared_staging
from govray.data.fingerprint import corpus_files, fingerprint_files
from govray.data.rowhash import ROW_HASH_VERSION
from govray.data.shards import (
    MANIFEST,
    SHARD_FORMAT_VERSION,
    CorpusSummary,
    RouteSummary,
    ShardFile,
    ShardManifest,
    ShardSet,
)
from govray.data.units import (
    HOLDOUT,
    ROWS_PER_UNIT,
    RowRefusal,
    UnitJob,
    UnitReport,
    split_block,
    unit_pieces,
    write_unit,
)
from govray.data.validate import check_file, diagnose_file, locate
from govray.governance.policy import VerifiedPolicy

# Parquet files whose schemas make a corpus's: the first ones, as Ray Data's DataSourceV2 samples
# them (``ray.data._internal.datasource_v2.common.listing_utils.sample_files``, Ray 2.60).
SCHEMA_SAMPLE = 16


@dataclass(frozen=True)
class IngestLoad:
    """How the ingest cut its work: no task held more than one block or one unit of rows."""

    blocks: int  # Ray Data blocks read, over all corpora
    largest_block_rows: int  # a block straddling units is cut by one task that holds it alone
    units: int  # unit tasks (each annotates and writes ROWS_PER_UNIT rows or fewer)
    largest_unit_rows: int  # the most rows one unit task received, as it counted them


@dataclass(frozen=True)
class IngestResult:
    root: Path
    manifest: ShardManifest
    reused: bool  # True when identical shards already existed
    load: IngestLoad


def _read(spec: CorpusSpec, files: Sequence[Path]) -> ray.data.Dataset:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # row numbers follow file order
    context.enable_progress_bars = False
    paths = [str(file) for file in files]
    fmt = spec.resolved_format.value
    # One read task per file (up to Ray Data's minimum of read tasks, 200: more files share tasks,
    # as by default), its blocks as the reader yields them (cut only where larger than Ray Data's
    # block size), not the 200 blocks Ray Data cuts after the read by default: units are fixed row
    # ranges whatever the blocks, so more blocks only cost. partitioning=None: no hive-style
    # columns from directory names.
    tasks = min(len(paths), context.read_op_min_num_blocks)
    options: dict[str, Any] = {"partitioning": None, "file_extensions": None, "override_num_blocks": tasks}
    if fmt == "parquet":
        # Ray 2.60's first Parquet reader: its default (DataSourceV2) lists and samples the files
        # in extra tasks and actors, 2.0-2.6 s against 0.9 s for ten files of 10^6 rows read here
        # (BENCHMARKS.md). The choice is made when the dataset is built; the setting is restored.
        # The first reader keeps each file's own schema; DataSourceV2 reads every file with the
        # schema of the first files unified (types promoted, missing columns null): that schema
        # is given here, so the rows (and their hashes) are the ones ingest always read; the
        # schema metadata the first reader keeps (pandas') is dropped by the units.
        schema = unify_schemas_with_validation([pq.read_schema(path) for path in paths[:SCHEMA_SAMPLE]])
        v2 = context.use_datasource_v2
        context.use_datasource_v2 = False
        try:
            return ray.data.read_parquet(paths, schema=schema, **options)
        finally:
            context.use_datasource_v2 = v2
    if fmt == "jsonl":
        return ray.data.read_json(paths, lines=True, **options)
    return ray.data.read_csv(paths, **options)


@ray.remote
def _num_rows(block: pa.Table) -> int:
    return block.num_rows


@ray.remote
def _check_file(file: str, format_name: str) -> str | None:
    return check_file(Path(file), format_name)


_fingerprint = ray.remote(fingerprint_files)


# The error a row's summary names, by its kind: each has its documented exit code.
_ROW_ERRORS: dict[str, type[GovrayError]] = {"credential": CredentialError, "policy": PolicyError}


@dataclass
class _Corpus:
    spec: CorpusSpec
    files: list[tuple[str, Path]]  # (relative path, file), sorted
    fingerprint: ray.ObjectRef  # of str
    units: list[ray.ObjectRef]  # of UnitReport, in row order
    rows: int
    block_sizes: list[int]


def ingest_key(
    config: ExperimentConfig,
    policy: VerifiedPolicy,
    fingerprints: dict[str, str],
) -> str:
    """Digest of everything the shards depend on."""
    return sha256_hex(
        canonical_json(
            {
                "row_hash_version": ROW_HASH_VERSION,
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


def _launch(
    spec: CorpusSpec,
    policy_json: str,
    default_holdout: float,
    staging: Path,
    launched: list[ray.ObjectRef],
) -> _Corpus:
    """Check a corpus's files, read it, and start its fingerprint and unit tasks (added to
    ``launched`` as they start: ingest stops them when anything fails)."""
    format_name = spec.resolved_format.value
    files = corpus_files(spec.path, format_name, corpus_id=spec.id)
    paths = [file for _, file in files]
    # Ray Data names nothing when it refuses a file, and accepts some bad ones: check each first.
    problems = ray.get([_check_file.remote(str(file), format_name) for file in paths])
    if problem := next((problem for problem in problems if problem), None):
        raise IngestError(f"corpus '{spec.id}': {problem}")
    fingerprint = _fingerprint.remote(files)
    launched.append(fingerprint)
    try:
        blocks = _read(spec, paths).to_arrow_refs()
    except Exception as error:  # Ray Data wraps reader errors: say which file failed, and where
        raise IngestError(f"corpus '{spec.id}': {_read_failure(paths, format_name, error)}") from None
    sizes = ray.get([_num_rows.remote(block) for block in blocks])
    if sum(sizes) == 0:
        raise IngestError(f"corpus '{spec.id}' ({spec.path}) is empty: it has no rows")
    holdout = spec.holdout_fraction if spec.holdout_fraction is not None else default_holdout
    spec_json = spec.model_dump_json()
    units = []
    for unit, pieces in enumerate(_unit_inputs(blocks, sizes)):
        first = unit * ROWS_PER_UNIT
        job = UnitJob(spec_json, policy_json, holdout, unit, first, str(staging))
        units.append(write_unit.remote(job, *pieces))
        launched.append(units[-1])
    return _Corpus(spec, files, fingerprint, units, sum(sizes), sizes)


def _unit_inputs(blocks: list[ray.ObjectRef], sizes: list[int]) -> list[list[ray.ObjectRef]]:
    """Per unit, the refs of its rows in order: a block that lies inside the unit as it is, and
    the pieces of a block that straddles units, cut by one ``split_block`` task per block."""
    plans = unit_pieces(sizes)
    bounds: dict[int, list[tuple[int, int]]] = {}
    for pieces in plans:
        for block, start, stop in pieces:
            bounds.setdefault(block, []).append((start, stop))
    refs: dict[tuple[int, int], ray.ObjectRef] = {}
    for block, cuts in bounds.items():
        if len(cuts) == 1:
            refs[block, 0] = blocks[block]
            continue
        split: Any = split_block.options(num_returns=len(cuts)).remote(blocks[block], cuts)
        for (start, _), piece in zip(cuts, split, strict=True):
            refs[block, start] = piece
    return [[refs[block, start] for block, start, _ in pieces] for pieces in plans]


def _collect(corpora: list[_Corpus]) -> list[list[UnitReport]]:
    """Every unit's report, per corpus in row order. Raises the refusal of the first bad row (in
    corpus order, then row): once a unit refuses, the units after it are cancelled."""
    refs = [ref for corpus in corpora for ref in corpus.units]
    order = {ref: index for index, ref in enumerate(refs)}
    reports: dict[int, UnitReport] = {}
    first_refusal = len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1, fetch_local=False)
        for ref in ready:
            index = order[ref]
            if index > first_refusal:
                continue  # cancelled: a unit before it refused a row
            try:
                reports[index] = report = ray.get(ref)
            except ray.exceptions.RayTaskError as error:
                raise IngestError(f"writing shards failed: {_root_cause(error)}") from None
            if report.refusal is not None and index < first_refusal:
                first_refusal = index
                for later in pending:
                    if order[later] > index:
                        ray.cancel(later)
    start = 0
    collected = []
    for corpus in corpora:
        mine = [reports[index] for index in range(start, min(start + len(corpus.units), first_refusal))]
        if first_refusal < start + len(corpus.units):
            refusal = reports[first_refusal].refusal
            assert refusal is not None
            raise _row_error(refusal, [file for _, file in corpus.files], corpus.spec.resolved_format.value)
        collected.append(mine)
        start += len(corpus.units)
    return collected


def _row_error(refusal: RowRefusal, files: list[Path], format_name: str) -> GovrayError:
    """The error of a unit's first bad row, with the file, row and line it sits at."""
    message = refusal.message
    if refusal.row is not None and (where := locate(files, format_name, refusal.row)):
        message += f" (at {where})"
    return _ROW_ERRORS[refusal.kind](message)


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


def ingest(
    config: ExperimentConfig,
    policy: VerifiedPolicy,
    *,
    force: bool = False,
) -> IngestResult:
    """Validate and shard every corpus of ``config`` under ``STORAGE/shards/KEY``, rows hashed as
    ``govray.data.rowhash`` defines.

    Raises ``IngestError`` naming the corpus, and the file, row and column at fault
    (``CredentialError`` for a row's bad credential, ``PolicyError`` for a row that matches no
    rule); leaves nothing under ``STORAGE/shards`` then. Rows count from 0, lines from 1
    (``govray.data.validate``).
    """
    storage = open_storage(config.storage_path)
    storage.check()  # unreachable object storage is refused before any corpus is read
    policy_json = policy.policy.model_dump_json()
    shards = storage.root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    # Unit tasks write here as they go; it becomes STORAGE/shards/KEY once every row is valid.
    staging = shared_staging(shards, ".ingest-")
    launched: list[ray.ObjectRef] = []
    try:
        corpora = [
            _launch(spec, policy_json, config.data.holdout_fraction, staging, launched)
            for spec in config.data.corpora
        ]
        reports = _collect(corpora)
        ids = [corpus.spec.id for corpus in corpora]
        fingerprints = dict(zip(ids, ray.get([corpus.fingerprint for corpus in corpora]), strict=True))
        key = ingest_key(config, policy, fingerprints)
        root = shards / key
        load = _load(corpora, reports)
        fetched = storage.fetch(root, verify=lambda staged: ShardSet.open(staged, verify=True))
        if fetched and (root / MANIFEST).exists() and not force:
            shutil.rmtree(staging)
            existing = ShardSet.open(root, verify=True)
            return IngestResult(root=root, manifest=existing.manifest, reused=True, load=load)
        manifest = _manifest(config, policy, corpora, reports, fingerprints, key)
        (staging / MANIFEST).write_text(manifest.to_json())
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)  # atomic: readers see complete shards or none
    except BaseException:
        stop_tasks(launched)  # nothing writes after ingest gives up
        shutil.rmtree(staging, ignore_errors=True)
        raise
    storage.upload(root)  # the manifest last: other nodes see complete shards or none
    return IngestResult(root=root, manifest=manifest, reused=False, load=load)


def _load(corpora: list[_Corpus], reports: list[list[UnitReport]]) -> IngestLoad:
    return IngestLoad(
        blocks=sum(len(corpus.block_sizes) for corpus in corpora),
        largest_block_rows=max(size for corpus in corpora for size in corpus.block_sizes),
        units=sum(len(units) for units in reports),
        largest_unit_rows=max(unit.received_rows for units in reports for unit in units),
    )


def _manifest(
    config: ExperimentConfig,
    policy: VerifiedPolicy,
    corpora: list[_Corpus],
    reports: list[list[UnitReport]],
    fingerprints: dict[str, str],
    key: str,
) -> ShardManifest:
    """Files in shard order (policy route, then corpus order, then row), and exact counts."""
    counts: list[dict[str, int]] = []
    for units in reports:
        total: dict[str, int] = {}
        for unit in units:
            for route, count in unit.counts.items():
                total[route] = total.get(route, 0) + count
        counts.append(total)

    def files(route: str, units: list[list[UnitReport]]) -> list[ShardFile]:
        return [file for corpus in units for unit in corpus for file in unit.files.get(route, [])]

    routes = [
        RouteSummary(
            route=route,
            rows=sum(count.get(route, 0) for count in counts),
            corpus_counts={c.spec.id: n[route] for c, n in zip(corpora, counts, strict=True) if n.get(route)},
            files=files(route, reports),
        )
        for route in policy.policy.routes()
    ]
    summaries = [
        CorpusSummary(
            corpus_id=corpus.spec.id,
            role=corpus.spec.role.value,
            format=corpus.spec.resolved_format.value,
            fingerprint=fingerprints[corpus.spec.id],
            files=[relative for relative, _ in corpus.files],
            rows=corpus.rows,
            train_rows=corpus.rows - count.get(HOLDOUT, 0),
            holdout_rows=count.get(HOLDOUT, 0),
            route_counts={route: n for route, n in count.items() if route != HOLDOUT},
            credential=corpus.spec.base_credential(),
            credential_columns=corpus.spec.credential_columns,
        )
        for corpus, count in zip(corpora, counts, strict=True)
    ]
    return ShardManifest(
        key=key,
        policy_name=policy.policy.name,
        policy_version=policy.policy.version,
        policy_digest=policy.digest,
        holdout_fraction=config.data.holdout_fraction,
        row_hash_version=ROW_HASH_VERSION,
        corpora=summaries,
        routes=routes,
        holdout={
            corpus.spec.id: files(HOLDOUT, [units])
            for corpus, units, count in zip(corpora, reports, counts, strict=True)
            if count.get(HOLDOUT)
        },
    )
