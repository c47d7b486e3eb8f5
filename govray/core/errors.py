"""Errors meant for people: each names the file, corpus, row, rule or key at fault."""

from __future__ import annotations

from pydantic import ValidationError


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


def describe_validation_error(error: ValidationError) -> str:
    """One clause per problem, ``field.path: message``, joined by '; '."""
    parts = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(root)"
        parts.append(f"{location}: {item['msg']}")
    return "; ".join(parts)
