"""The lineage server's configuration (``govray serve``, the app in ``serve/``): which tracking
store it reads, which keys it trusts, the token its write endpoints require, and where it listens.

The user's settings (``GOVRAY_HOME/config.yaml``: ``trust``, ``store.database_url`` and the ``serve`` section,
each overridable by its environment variable, ``govray.core.settings``), then a serve config file
(``govray serve --config``, or the app's ``config`` argument) whose keys win, then command-line
options::

    database_url: sqlite:///runs/tracking.db   # (settings: store.database_url, GOVRAY_DATABASE)
    trust: policies/trust.yaml                 # keys POST /api/verify accepts (settings: trust, GOVRAY_TRUST)
    token: s3cret                              # bearer token of the write endpoints (GOVRAY_SERVE_TOKEN)
    host: 127.0.0.1                            # (GOVRAY_SERVE_HOST)
    port: 8000                                 # (GOVRAY_SERVE_PORT)

Without a token the write endpoints refuse every request; without a trust file ``/api/verify``
answers 503.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from govray.core.errors import ConfigError, describe_validation_error
from govray.core.settings import load_settings, settings_path
from govray.core.yaml_files import parse_yaml_mapping, read_text


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
        """The user's settings (``environ``: the environment they are read with), overridden by
        ``config``, then by ``overrides`` (options given on a command line); ``ConfigError`` names
        what is missing or wrong."""
        settings = load_settings(environ)
        values = {key: value for key, value in settings.serve.model_dump().items() if value is not None}
        if settings.trust is not None:
            values["trust"] = settings.trust  # the operator's trust (``trust``, GOVRAY_TRUST)
        if settings.store.database_url:
            values["database_url"] = settings.store.database_url
        where = f"{settings_path(environ)} and the environment"
        if config is not None:
            text = read_text(config, ConfigError, "serve config")
            values.update(parse_yaml_mapping(text, str(config), ConfigError, "a serve config is a mapping"))
            where = str(config)
        values.update({key: value for key, value in (overrides or {}).items() if value is not None})
        if "database_url" not in values:
            raise ConfigError(
                f"no tracking store given: set store.database_url in {settings_path(environ)}, "
                "GOVRAY_DATABASE, --database, or database_url in the serve config"
            )
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ConfigError(f"serve settings from {where}: {describe_validation_error(error)}") from None
