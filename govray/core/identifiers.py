"""The identifiers a user can send govray, declared once and checked where they enter (HTTP in
``serve/``, the CLI, the registry's Python API).

Each is a pydantic type whose pattern must match the **whole** text: no trailing-newline loophole,
no control character, no NUL (PostgreSQL cannot store one), and a length bound, so a malformed id
is refused at the edge with a message instead of reaching the database. Nothing is normalised:
``"digits\\n"`` is not ``"digits"``, it is refused. Numbers are SQL ``BIGINT`` ids (1 ..
``MAX_ID``); a larger, non-finite or non-ASCII-digit one is malformed, not unknown::

    check(ModelName, "digits", "model name")        # -> "digits"
    check(ModelName, "digits\\n", "model name")      # IdentifierError naming what is allowed
    parse_model_ref("digits:2")                      # -> ("digits", 2)
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field, StringConstraints, TypeAdapter, ValidationError

from govray.core.errors import GovrayError

MAX_ID = 2**63 - 1  # ids are SQL BIGINTs (SQLite and PostgreSQL alike)

# Bodies without anchors: pydantic anchors them (its regex engine's ``$`` is the end of the text),
# ``fullmatch`` below too; an OpenAPI reader sees ``^...$`` with ECMA semantics (also the end).
MODEL_NAME_BODY = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
CORPUS_ID_BODY = r"[a-z0-9][a-z0-9._-]{0,127}"  # govray.governance.credentials.CORPUS_ID_PATTERN's
EXPERIMENT_NAME_BODY = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
TAG_KEY_BODY = r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}"
# Free text (layer and metric names, tag values): printable, no control character at all.
LABEL_BODY = r"[^\x00-\x1f\x7f]*"
# A description may span lines; still no NUL or other control character.
DESCRIPTION_BODY = r"[^\x00-\x08\x0b-\x1f\x7f]*"


def _text(body: str, max_length: int, description: str) -> Any:
    return Annotated[
        str,
        StringConstraints(pattern=f"^{body}$", max_length=max_length),
        Field(description=description),
    ]


ModelName = _text(MODEL_NAME_BODY, 128, "A model name: a letter or digit, then letters, digits, . _ -")
CorpusId = _text(CORPUS_ID_BODY, 128, "A corpus id: a lower-case letter or digit, then a-z 0-9 . _ -")
ExperimentName = _text(EXPERIMENT_NAME_BODY, 128, "An experiment name: letters, digits, . _ -")
ModelRef = _text(
    f"{MODEL_NAME_BODY}(:[0-9]{{1,19}})?", 148, "A model version: NAME (the latest) or NAME:VERSION"
)
TagKey = _text(TAG_KEY_BODY, 128, "A tag: a letter or digit, then letters, digits, . _ / -")
TagValue = _text(LABEL_BODY, 1024, "A tag's value: printable text")
Label = _text(LABEL_BODY, 512, "A layer or metric name: printable text")
Description = _text(
    DESCRIPTION_BODY, 4096, "Free text, without control characters other than newline and tab"
)
DECIMAL_BODY = r"0|[1-9][0-9]{0,18}"  # how a number is written in a path, a query or on a command line


def _exact_integer(value: object) -> object:
    """An integer, or its decimal text exactly: not ' 1', '1\n', '01', '+1', '1_0' or '1.0', each of
    which pydantic's lax mode (or ``int``) would read as a number, mapping one id onto another."""
    if isinstance(value, bool | float):
        raise ValueError("expected an integer")
    if isinstance(value, str):
        if not re.fullmatch(DECIMAL_BODY, value):
            raise ValueError("expected an integer written in ASCII digits, without sign or leading zeros")
        return int(value)
    return value


def _iso_moment(value: object) -> object:
    """A time as ISO 8601 text (pydantic's lax mode would also read '0.5' as a Unix timestamp)."""
    if isinstance(value, str) and re.fullmatch(r"[0-9.eE+-]*", value):
        raise ValueError("expected an ISO 8601 date-time, such as 2026-11-21T12:00:00Z")
    return value


Moment = Annotated[datetime, BeforeValidator(_iso_moment)]
EXACT_INTEGER = BeforeValidator(_exact_integer)  # last in an Annotated, so it runs first
RecordId = Annotated[int, Field(ge=1, le=MAX_ID, description=f"An id (1..{MAX_ID})."), EXACT_INTEGER]
Version = Annotated[int, Field(ge=1, le=MAX_ID, description="A model version (1, 2, ...)."), EXACT_INTEGER]
RowNumber = Annotated[int, Field(ge=0, le=MAX_ID, description="A row of a corpus (0-based)."), EXACT_INTEGER]

RULES = {  # what a refusal says is allowed
    MODEL_NAME_BODY: "a letter or digit, then letters, digits and ._- (at most 128 characters)",
    CORPUS_ID_BODY: "a lower-case letter or digit, then a-z, 0-9 and ._- (at most 128 characters)",
    TAG_KEY_BODY: "a letter or digit, then letters, digits and ._/- (at most 128 characters)",
    LABEL_BODY: "printable text, without control characters",
    DESCRIPTION_BODY: "text without control characters other than newline and tab",
}

Value = TypeVar("Value")


class IdentifierError(GovrayError):
    """An identifier that is not one: the wrong characters, too long, out of range."""

    exit_code = 2


def check(kind: Any, value: object, what: str, error: type[GovrayError] = IdentifierError) -> Any:
    """``value`` if it is a ``kind`` (one of the types above), else ``error`` naming ``what`` and
    the rule it breaks."""
    try:
        return _adapter(kind).validate_python(value, strict=True)
    except ValidationError as problem:
        reason = problem.errors()[0]["msg"]
        pattern = problem.errors()[0].get("ctx", {}).get("pattern", "")
        rule = RULES.get(str(pattern).removeprefix("^").removesuffix("$"))
        shown = _shown(value)
        raise error(f"{what} {shown}: {'expected ' + rule if rule else reason}") from None


def parse_id(text: str, what: str, error: type[GovrayError] = IdentifierError, low: int = 1) -> int:
    """A decimal number typed by a person: ASCII digits only (``int`` also reads other scripts'
    digits, signs, underscores and spaces), within ``low``..MAX_ID."""
    if not re.fullmatch(DECIMAL_BODY, text) or not low <= int(text) <= MAX_ID:
        raise error(f"{what} {_shown(text)}: expected a number from {low} to {MAX_ID}")
    return int(text)


def parse_model_ref(ref: str, error: type[GovrayError] = IdentifierError) -> tuple[str, int | None]:
    """``NAME`` (the latest version) or ``NAME:VERSION``, both checked."""
    name, colon, version = ref.partition(":")
    if not re.fullmatch(MODEL_NAME_BODY, name):
        rule = RULES[MODEL_NAME_BODY]
        raise error(f"model reference {_shown(ref)}: expected NAME or NAME:VERSION, the name {rule}")
    if not colon:
        return name, None
    return name, parse_id(version, f"model reference {_shown(ref)}: the version", error)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(str(value))} characters)"


_ADAPTERS: dict[int, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    found = _ADAPTERS.get(id(kind))
    if found is None:
        found = _ADAPTERS[id(kind)] = TypeAdapter(kind)
    return found
