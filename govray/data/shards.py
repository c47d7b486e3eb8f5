"""Route-partitioned shards on storage, and the manifest that indexes them.

Layout under ``STORAGE/shards/KEY/`` (KEY digests every input of the ingest, so a changed corpus,
policy or holdout fraction gets new shards and an unchanged one reuses them)::

    manifest.json                    counts, fingerprints, files (no timestamps: re-ingest is byte-identical)
    train/ROUTE/part-00000.parquet   training rows of one route, ordered by (corpus order, row)
    holdout/CORPUS/part-00000.parquet  holdout rows of a training corpus; every row of an eval corpus

Each shard row keeps its source columns plus ``_corpus``, ``_row`` (0-based row number within
the corpus, files in sorted order), ``_row_hash`` (sha256 of the row's canonical JSON),
``_route`` and ``_credential`` (the row's full credential, canonical JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from govray.core.canonical import file_sha256
from govray.core.errors import IngestError
from govray.core.storage import open_storage

MANIFEST = "manifest.json"
SHARD_FORMAT_VERSION = 1
ROW_COLUMNS = ("_corpus", "_row", "_row_hash", "_route", "_credential")


class ShardFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str  # relative to the shard directory
    rows: int
    sha256: str


class CorpusSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus_id: str
    role: str
    format: str
    fingerprint: str
    files: list[str]
    rows: int
    train_rows: int
    holdout_rows: int
    route_counts: dict[str, int]  # training rows per route
    credential: dict[str, object]  # the corpus-level credential
    credential_columns: dict[str, str]


class RouteSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    route: str
    rows: int
    corpus_counts: dict[str, int]
    files: list[ShardFile]


class ShardManifest(BaseModel):
    """Everything the schedule and the ledger need to know about the ingested data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = SHARD_FORMAT_VERSION
    key: str
    policy_name: str
    policy_version: int
    policy_digest: str
    holdout_fraction: float
    corpora: list[CorpusSummary]
    routes: list[RouteSummary]  # in policy order; routes with no rows are listed with rows=0
    holdout: dict[str, list[ShardFile]] = Field(default_factory=dict)  # corpus → files

    def route(self, key: str) -> RouteSummary:
        for route in self.routes:
            if route.route == key:
                return route
        raise IngestError(f"shards {self.key} have no route '{key}'")

    def corpus(self, corpus_id: str) -> CorpusSummary:
        for corpus in self.corpora:
            if corpus.corpus_id == corpus_id:
                return corpus
        raise IngestError(f"shards {self.key} have no corpus '{corpus_id}'")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


class ShardSet:
    """Read access to one ingest's shards."""

    def __init__(self, root: Path, manifest: ShardManifest) -> None:
        self.root = root
        self.manifest = manifest

    @classmethod
    def open(cls, root: Path, *, verify: bool = False) -> ShardSet:
        path = root / MANIFEST
        try:
            manifest = ShardManifest.model_validate_json(path.read_text())
        except OSError as error:
            raise IngestError(f"no shard manifest at {path}: {error.strerror}") from None
        shards = cls(root, manifest)
        if verify:
            shards.verify()
        return shards

    @classmethod
    def fetch_manifest(cls, root: Path, storage: str, sha256: str = "") -> ShardSet:
        """The shard set at ``root``, its manifest fetched from object storage ``storage`` when this
        node lacks it (a local storage_path or "": read where it lies) and checked against
        ``sha256``, the digest the run recorded in its signed run.json ("": a run recorded before
        it was). Its files are fetched and checked one at a time, when read (``ShardReader``)."""
        path = root / MANIFEST

        def check(candidate: Path) -> None:
            if sha256 and file_sha256(candidate) != sha256:
                raise IngestError(f"shard manifest {path} does not match the digest the run recorded")

        if storage:
            open_storage(storage).fetch(path, verify=check)
        shards = cls.open(root)
        check(path)
        return shards

    def verify(self) -> None:
        """Check every shard file's digest against the manifest."""
        files = [file for route in self.manifest.routes for file in route.files]
        files += [file for group in self.manifest.holdout.values() for file in group]
        for file in files:
            path = self.root / file.path
            if not path.exists():
                raise IngestError(f"shard file {path} listed in the manifest is missing")
            if file_sha256(path) != file.sha256:
                raise IngestError(f"shard file {path} does not match its digest in the manifest")

    def route_table(self, route: str, columns: Sequence[str] | None = None) -> pa.Table:
        """All training rows of ``route``, in shard order."""
        return self._read(self.manifest.route(route).files, columns)

    def holdout_table(self, corpus_id: str, columns: Sequence[str] | None = None) -> pa.Table:
        if corpus_id not in self.manifest.holdout:
            raise IngestError(f"shards {self.manifest.key} hold no holdout rows of corpus '{corpus_id}'")
        return self._read(self.manifest.holdout[corpus_id], columns)

    def _read(self, files: Sequence[ShardFile], columns: Sequence[str] | None) -> pa.Table:
        tables = [
            pq.read_table(self.root / file.path, columns=list(columns) if columns else None) for file in files
        ]
        if not tables:
            raise IngestError(f"shards {self.manifest.key}: nothing to read")
        return pa.concat_tables(tables)
