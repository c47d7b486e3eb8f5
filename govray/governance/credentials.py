"""Provenance credentials: what every training example carries.

A credential names the corpus an example came from and the facts a reviewer needs about it:
license class, jurisdiction, sensitivity, and what the EU AI Act training-content summary asks
for (source type, modality, whether a text-and-data-mining opt-out was expressed, collection
period). Fields with a closed vocabulary are enums, so a typo is refused at the edge.

Example::

    Credential(corpus_id="digits-public", license_class="public-domain", jurisdiction="US",
               sensitivity="public", source_type="public-dataset", modality="image",
               tdm_opt_out=False, collection_period={"start": "1998-01-01", "end": "1998-12-31"})
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from govray.core.errors import CredentialError, describe_validation_error

CORPUS_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
# ISO 3166-1 alpha-2 country codes, plus EU (union-wide) and INTL (no single jurisdiction).
JURISDICTION_PATTERN = r"^([A-Z]{2}|EU|INTL)$"


class LicenseClass(StrEnum):
    PUBLIC_DOMAIN = "public-domain"
    PERMISSIVE = "permissive"  # e.g. CC-BY, MIT: use allowed with attribution
    COPYLEFT = "copyleft"  # e.g. CC-BY-SA, GPL: share-alike obligations
    NON_COMMERCIAL = "non-commercial"  # e.g. CC-BY-NC
    LICENSED = "licensed"  # under a private contract
    PROPRIETARY = "proprietary"  # the organisation's own data
    UNKNOWN = "unknown"


class Sensitivity(StrEnum):
    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    PII = "pii"  # personal data (GDPR art. 4)
    SPECIAL_CATEGORY = "special-category"  # GDPR art. 9: health, religion, ...


class SourceType(StrEnum):
    """The EU AI Act summary template's categories of data source."""

    PUBLIC_DATASET = "public-dataset"
    LICENSED_PRIVATE = "licensed-private"
    CRAWLED = "crawled"
    USER_DATA = "user-data"
    SYNTHETIC = "synthetic"
    OTHER = "other"


class Modality(StrEnum):
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"
    TABULAR = "tabular"
    CODE = "code"
    OTHER = "other"


class CollectionPeriod(BaseModel):
    """When the data was collected (inclusive dates)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: dt.date
    end: dt.date

    @model_validator(mode="after")
    def _ordered(self) -> CollectionPeriod:
        if self.end < self.start:
            raise ValueError(f"collection period ends ({self.end}) before it starts ({self.start})")
        return self


class Credential(BaseModel):
    """The provenance credential of one example (or of a whole corpus)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    corpus_id: str = Field(pattern=CORPUS_ID_PATTERN)
    license_class: LicenseClass
    jurisdiction: str = Field(pattern=JURISDICTION_PATTERN)
    sensitivity: Sensitivity
    source_type: SourceType
    modality: Modality
    tdm_opt_out: bool = False
    collection_period: CollectionPeriod
    # Optional facts the EU summary uses when known.
    provider: str | None = None
    domains: tuple[str, ...] = ()  # for crawled data: the web domains it came from
    description: str = ""

    def field_value(self, name: str) -> Any:
        """The value of a credential field as policies compare it (enums by their string)."""
        value = getattr(self, name)
        return value.value if isinstance(value, StrEnum) else value


# Fields a policy rule may match on; per-row credential columns may set all but the corpus id.
MATCHABLE_FIELDS: tuple[str, ...] = (
    "corpus_id",
    "license_class",
    "jurisdiction",
    "sensitivity",
    "source_type",
    "modality",
    "tdm_opt_out",
)
ROW_OVERRIDABLE_FIELDS: tuple[str, ...] = tuple(field for field in MATCHABLE_FIELDS if field != "corpus_id")


def build_credential(base: dict[str, Any], *, where: str) -> Credential:
    """Validate a credential from plain values, raising ``CredentialError`` that says where."""
    try:
        return Credential.model_validate(base)
    except ValidationError as error:
        raise CredentialError(f"{where}: invalid credential: {describe_validation_error(error)}") from None
