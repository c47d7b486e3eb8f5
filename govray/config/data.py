"""The experiment's ``data:`` section: the corpora, each with its credential and role, and how
text is packed. Paths are those the experiment file gives, made absolute by its loader."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from govray.core.errors import ConfigError, describe_validation_error
from govray.governance.credentials import CORPUS_ID_PATTERN, ROW_OVERRIDABLE_FIELDS, Credential

_STRICT = ConfigDict(extra="forbid", frozen=True)


class CorpusFormat(StrEnum):
    PARQUET = "parquet"
    JSONL = "jsonl"
    CSV = "csv"


_EXTENSIONS = {".parquet": CorpusFormat.PARQUET, ".jsonl": CorpusFormat.JSONL, ".csv": CorpusFormat.CSV}
# In a directory, the files ingest reads for each format (``.json`` files as JSON lines).
DIRECTORY_EXTENSIONS = {**_EXTENSIONS, ".json": CorpusFormat.JSONL}


class CorpusRole(StrEnum):
    TRAIN = "train"  # routed by the policy; split into training and holdout by row hash
    VALIDATION = "validation"  # evaluation only, never routed
    PROBE = "probe"  # memorization probes and canaries, never routed


class CanaryConfig(BaseModel):
    """A corpus's inserted canaries (a :class:`govray.governance.canaries.CanarySet` JSON file) and how many
    never-trained candidates each canary is ranked among for its exposure (the rank definition:
    at most log2(references + 1) bits)."""

    model_config = _STRICT

    file: Path
    references: int = Field(default=1000, ge=10)


class CorpusSpec(BaseModel):
    """One corpus: where it is, its credential, and which columns override it per row."""

    model_config = _STRICT

    id: str = Field(pattern=CORPUS_ID_PATTERN)
    path: Path
    format: CorpusFormat | None = None  # inferred from the file extension when omitted
    role: CorpusRole = CorpusRole.TRAIN
    credential: dict[str, Any]  # every credential field but corpus_id (taken from ``id``)
    credential_columns: dict[str, str] = Field(default_factory=dict)  # field → column name
    holdout_fraction: float | None = Field(default=None, ge=0.0, lt=1.0)
    canaries: CanaryConfig | None = None

    @field_validator("credential", mode="before")
    @classmethod
    def _plain_json(cls, credential: Any) -> Any:
        # YAML reads 1998-01-01 as a date; keep the credential JSON-plain so it can be hashed.
        return json.loads(json.dumps(credential, default=str)) if isinstance(credential, dict) else credential

    @field_validator("credential_columns")
    @classmethod
    def _overridable(cls, columns: dict[str, str]) -> dict[str, str]:
        for field in columns:
            if field not in ROW_OVERRIDABLE_FIELDS:
                raise ValueError(
                    f"'{field}' cannot be set per row (allowed: {', '.join(ROW_OVERRIDABLE_FIELDS)})"
                )
        return columns

    @model_validator(mode="after")
    def _credential_complete(self) -> CorpusSpec:
        if "corpus_id" in self.credential and self.credential["corpus_id"] != self.id:
            raise ValueError(
                f"credential.corpus_id '{self.credential['corpus_id']}' differs from id '{self.id}'"
            )
        # Fields set per row may be absent at corpus level; everything else must validate now.
        probe = {**self.credential, "corpus_id": self.id}
        for field in self.credential_columns:
            probe.setdefault(field, _placeholder(field))
        try:
            Credential.model_validate(probe)
        except ValidationError as error:
            raise ValueError(f"credential: {describe_validation_error(error)}") from None
        return self

    @property
    def resolved_format(self) -> CorpusFormat:
        """``format``, else the file's extension, else the one extension every data file of the
        directory shares (hidden files and ``_SUCCESS``-style markers aside)."""
        if self.format is not None:
            return self.format
        if self.path.is_dir():
            return self._directory_format()
        suffix = self.path.suffix.lower()
        if suffix not in _EXTENSIONS and not self.path.exists():
            raise ConfigError(f"corpus '{self.id}': path {self.path} does not exist")
        if suffix not in _EXTENSIONS:
            raise ConfigError(
                f"corpus '{self.id}': cannot tell the format of {self.path}; set 'format' "
                f"({', '.join(f.value for f in CorpusFormat)})"
            )
        return _EXTENSIONS[suffix]

    def _directory_format(self) -> CorpusFormat:
        found: dict[str, int] = {}
        for file in self.path.rglob("*"):
            relative = file.relative_to(self.path)
            if any(part.startswith((".", "_")) for part in relative.parts) or not file.is_file():
                continue
            suffix = file.suffix.lower() or "(none)"
            found[suffix] = found.get(suffix, 0) + 1
        formats = {DIRECTORY_EXTENSIONS.get(suffix) for suffix in found}
        if len(formats) == 1 and None not in formats:
            return formats.pop()  # type: ignore[return-value]
        if not found:
            raise ConfigError(f"corpus '{self.id}': directory {self.path} holds no files")
        listed = ", ".join(f"{count} {suffix}" for suffix, count in sorted(found.items()))
        raise ConfigError(
            f"corpus '{self.id}': cannot tell the format of directory {self.path}: its files have "
            f"different or unknown extensions ({listed}); set 'format' "
            f"({', '.join(f.value for f in CorpusFormat)}) to read only that format's files"
        )

    def base_credential(self) -> dict[str, Any]:
        return {**self.credential, "corpus_id": self.id}


def _placeholder(field: str) -> Any:
    """A valid stand-in for a field that each row supplies (only for the corpus-level check)."""
    return {
        "license_class": "unknown",
        "jurisdiction": "INTL",
        "sensitivity": "public",
        "source_type": "other",
        "modality": "other",
        "tdm_opt_out": False,
    }[field]


EVAL_ROWS = 50_000  # held-out rows per corpus a validation evaluates, unless data.eval_rows says


class PackingConfig(BaseModel):
    """Text packed into fixed-length windows of ``seq_len`` tokens (the trial's ``tokenize``); a
    window holds rows of one route and one corpus only (:mod:`govray.data.packing`)."""

    model_config = _STRICT

    seq_len: int = Field(ge=2)  # tokens per window: a model sees at least one next-token target


class DataConfig(BaseModel):
    model_config = _STRICT

    holdout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    corpora: list[CorpusSpec] = Field(min_length=1)
    # Held-out rows per corpus a validation evaluates, evenly spaced over the holdout: a validation
    # costs the same whatever the corpus's size (recorded in every run.json).
    eval_rows: int = Field(default=EVAL_ROWS, ge=1)
    packing: PackingConfig | None = None  # None: a batch is rows, not packed windows

    @field_validator("corpora")
    @classmethod
    def _unique_ids(cls, corpora: list[CorpusSpec]) -> list[CorpusSpec]:
        seen: set[str] = set()
        for corpus in corpora:
            if corpus.id in seen:
                raise ValueError(f"corpus id '{corpus.id}' appears more than once")
            seen.add(corpus.id)
        return corpora

    @model_serializer(mode="wrap")
    def _without_defaults_added_later(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left at their defaults, eval_rows and packing are not serialized: an experiment written
        # before they existed keeps its bytes and its digest.
        dumped: dict[str, Any] = handler(self)
        if self.eval_rows == EVAL_ROWS:
            dumped.pop("eval_rows", None)
        if self.packing is None:
            dumped.pop("packing", None)
        return dumped
