"""The lineage server's configuration (``govray serve``, the app in ``serve/``): which tracking
store it reads, which keys it trusts, the token its write endpoints require, and where it listens.

Read from the environment, then from a YAML file (``GOVRAY_SERVE_CONFIG`` or
``govray serve --config``), the file's keys winning::

    database_url: sqlite:///runs/tracking.db   # GOVRAY_DATABASE_URL (or GOVRAY_DATABASE, the CLI's)
    trust: policies/trust.yaml                 # GOVRAY_TRUST: keys POST /api/verify accepts
    token: s3cret                              # GOVRAY_SERVE_TOKEN: bearer token of the write endpoints
    host: 127.0.0.1                            # GOVRAY_SERVE_HOST
    port: 8000                                 # GOVRAY_SERVE_PORT

Without a token the write endpoints refuse every request; without a trust file ``/api/verify``
answers 503.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from govray.core.documents import parse_yaml_mapping, read_text
from govray.core.errors import ConfigError, describe_validation_error

ENVIRONMENT = {
    "database_url": ("GOVRAY_DATABASE_URL", "GOVRAY_DATABASE"),
    "trust": ("GOVRAY_TRUST",),
    "token": ("GOVRAY_SERVE_TOKEN",),
    "host": ("GOVRAY_SERVE_HOST",),
    "port": ("GOVRAY_SERVE_PORT",),
}
CONFIG_VARIABLE = "GOVRAY_SERVE_CONFIG"


class ServeSettings(BaseModel):
    """What ``govray serve`` and ``serve run serve.app:app`` start the lineage app with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    database_url: str = Field(description="The tracking store, read read-only (writes use the registry).")
    trust: Path | None = Field(default=None, description="Trust file that /api/verify checks keys against.")
    token: SecretStr | None = Field(default=None, description="Bearer token of the write endpoints.")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)

    @classmethod
    def load(
        cls,
        config: Path | None = None,
        overrides: Mapping[str, object] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ServeSettings:
        """The environment's settings, overridden by ``config`` (or ``$GOVRAY_SERVE_CONFIG``),
        then by ``overrides`` (options given on a command line); ``ConfigError`` names what is
        missing or wrong."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field, names in ENVIRONMENT.items():
            found = next((environ[name] for name in names if environ.get(name)), None)
            if found is not None:
                values[field] = found
        path = config if config is not None else _path(environ.get(CONFIG_VARIABLE))
        where = "the environment"
        if path is not None:
            text = read_text(path, ConfigError, "serve config")
            values.update(parse_yaml_mapping(text, str(path), ConfigError, "a serve config is a mapping"))
            where = str(path)
        values.update({key: value for key, value in (overrides or {}).items() if value is not None})
        if "database_url" not in values:
            raise ConfigError(
                "no tracking store given: set GOVRAY_DATABASE_URL, or database_url in the serve config"
            )
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ConfigError(f"serve settings from {where}: {describe_validation_error(error)}") from None


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None
