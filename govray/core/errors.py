"""Errors meant for people: each names the file, corpus, row, rule or key at fault."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails


class GovrayError(Exception):
    """Base of every error govray raises on purpose; the CLI prints it and exits non-zero."""

    exit_code = 1


class ConfigError(GovrayError):
    """An experiment file is malformed; the message names the file and the field path."""

    exit_code = 2


class CredentialError(GovrayError):
    """A provenance credential is missing or invalid (names corpus, row and field)."""

    exit_code = 3


class PolicyError(GovrayError):
    """A depth policy is malformed, or a credential matches no rule."""

    exit_code = 4


class SignatureError(GovrayError):
    """A signature is missing, does not verify, or comes from an untrusted or revoked key."""

    exit_code = 5


class RoutingError(GovrayError):
    """A policy cannot be resolved against a model (a glob or range matches nothing, ...)."""

    exit_code = 6


class IngestError(GovrayError):
    """A corpus cannot be ingested (missing path, empty corpus, bad row, duplicate id)."""

    exit_code = 7


class TrackingError(GovrayError):
    """The tracking store is unreachable, behind its migrations, or its audit chain is broken."""

    exit_code = 8


class AttestationError(GovrayError):
    """An attestation cannot be made, or does not verify (the message says what broke)."""

    exit_code = 16


# Collections whose items a message names by their ``id`` (``corpus 'news'``, not ``data.corpora.0``).
NAMED_ITEMS = {"corpora": "corpus"}
# The keys whose value selects a model of a tagged union: pydantic puts the tag in the location
# (``hyperparameters.lr.log.base``, ``searcher.asha.max_trials``), where the user's file has none;
# a ``name`` stays, as the item's name (``searcher 'asha': max_trials is required``).
_TAG_KEYS = ("type", "name")
_SUBJECTS = ("Input ", "String ", "List ", "Value ", "Dictionary ", "Tuple ", "Set ", "Object ")


def describe_validation_error(error: ValidationError, source: object = None) -> str:
    """One sentence per problem, about the user's file, joined by '; '.

    ``source`` is the document that was validated (the mapping read from the file): with it, an
    item of a named collection is named by its id (``corpus 'news': path is required``) and a
    union's tag leaves the location. pydantic's prefixes (``Value error,``) never appear.
    """
    return "; ".join(_sentence(item, source) for item in error.errors())


def spelled_location(location: tuple[str | int, ...], source: object = None) -> str:
    """``location`` as the user's file spells it: dotted keys, ``corpus 'ID'`` for a named item,
    without the tags pydantic adds for tagged unions ('' for the whole document)."""
    parts: list[str] = []
    node = source
    for key in location:
        if isinstance(node, dict) and key not in node and any(node.get(tag) == key for tag in _TAG_KEYS):
            if parts and node.get("name") == key:  # a named strategy: ``searcher 'asha'``
                parts[-1] = f"{parts[-1]} '{key}'"
            continue  # a union's tag, not a key of the file
        parent = parts[-1] if parts else None
        child = node[key] if isinstance(node, dict) and key in node else None
        if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            child = node[key]
            noun = NAMED_ITEMS.get(str(parent).rpartition(".")[2]) if parent is not None else None
            if noun is not None and isinstance(child, dict) and isinstance(child.get("id"), str):
                parts = [f"{noun} '{child['id']}'"]
                node = child
                continue
        parts.append(str(key))
        node = child
    text = ""
    for part in parts:
        text = part if not text else f"{text}: {part}" if text.endswith("'") else f"{text}.{part}"
    return text


def _sentence(item: ErrorDetails, source: object) -> str:
    where = spelled_location(item["loc"], source)
    kind, message, ctx = item["type"], item["msg"], item.get("ctx", {})
    if kind in ("value_error", "assertion_error"):  # the validator's own words, without the prefix
        message = str(ctx.get("error", message))
    elif kind == "missing":
        return f"{where} is required" if where else "a required field is missing"
    elif kind == "extra_forbidden":
        within = spelled_location(item["loc"][:-1], source)
        unknown = f"unknown field '{item['loc'][-1]}'"
        return f"{within}: {unknown}" if within else unknown
    elif kind == "union_tag_invalid":
        key = str(ctx.get("discriminator", "type")).strip("'")
        message = f"{key} '{ctx.get('tag')}' is none of {ctx.get('expected_tags')}"
    elif where and message.startswith(_SUBJECTS) and " should " in message:
        return f"{where} should {message.split(' should ', 1)[1]}"
    return f"{where}: {message}" if where else message
