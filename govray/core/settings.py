"""The user's settings: one file, ``GOVRAY_HOME/config.yaml`` (``~/.govray/config.yaml``), each
setting overridable by one documented environment variable, and a command-line option over both::

    trust: /etc/govray/trust.yaml                # GOVRAY_TRUST: the operator's trust (below)
    unsigned_policies: [scratch-experiment]      # experiments that may run (and register) unsigned policies
    store:
      database_url: sqlite:///runs/tracking.db   # GOVRAY_DATABASE (CLI: --database)
    serve:
      token: s3cret                              # GOVRAY_SERVE_TOKEN: bearer token of the write endpoints
      host: 127.0.0.1                            # GOVRAY_SERVE_HOST
      port: 8000                                 # GOVRAY_SERVE_PORT
    timestamping:
      url: http://tsa.internal/                  # GOVRAY_TSA_URL: RFC 3161 stamps on every signature
    signer:
      socket: /run/govray-signer/signer.sock     # GOVRAY_SIGNER_SOCKET: the platform's signer (below)
    trial_hosts:
      enabled: true                              # GOVRAY_TRIAL_HOSTS (0 or 1)
      idle_s: 300                                # GOVRAY_TRIAL_HOST_IDLE_S
    cache: ~/.cache/govray                       # GOVRAY_CACHE: this node's cache of object storage

``trust`` is the operator's: the platform keys (and their revocations) every verification of a
checkpoint or attestation accepts — a resume, a replay, ``attest``, ``model register``, the
lineage server. It is never read from an experiment file, a run spec or a checkpoint, which the
engineer who runs them writes (``operator_trust``). Without it, this machine's platform key alone.
Where it is set, its policy authorities are the only ones a run's policy may be signed by, and an
unsigned policy runs only for an experiment ``unsigned_policies`` names
(``platform/run/preflight.check_policy``).

``signer.socket`` is where each node's ``govray signer serve`` listens: a run's launch opens the
run there and its workers have their checkpoints sealed over it, never holding a key. Without
it, this machine's development signer (``govray.signer.local``).

``GOVRAY_HOME`` itself says where the file is (and this machine's keys, logs and Ray head record).
Every section and key is optional; an unknown one is refused, naming the file. govray reads these
variables and never sets one: ``OVERRIDES`` is the whole list.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from govray.core.errors import ConfigError, SignatureError, describe_validation_error
from govray.core.keys import (
    KeyRole,
    SigningKey,
    TrustConfig,
    govray_home,
    load_trust,
    platform_key_path,
    platform_public_key,
    platform_trust,
)
from govray.core.yaml_files import parse_yaml_mapping, read_text

SETTINGS_FILE = "config.yaml"
_STRICT = ConfigDict(extra="forbid", frozen=True)


class StoreSettings(BaseModel):
    model_config = _STRICT

    database_url: str | None = Field(default=None, description="The tracking store's URL.")


class ServeSection(BaseModel):
    """The lineage server's own settings (its store is ``store.database_url``)."""

    model_config = _STRICT

    token: SecretStr | None = Field(default=None, description="Bearer token of the write endpoints.")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)


class TimestampingSettings(BaseModel):
    """Where signatures get their trusted time: an RFC 3161 time-stamping authority."""

    model_config = _STRICT

    url: str | None = Field(
        default=None, description="The TSA's URL (RFC 3161 over HTTP): every signature made here is stamped."
    )


class SignerSettings(BaseModel):
    """Where the platform's signer listens (a Unix socket on every node of the cluster)."""

    model_config = _STRICT

    socket: Path | None = Field(
        default=None,
        description="The signer's Unix socket: runs' checkpoints are sealed there (none: this machine's "
        "development signer).",
    )


class TrialHostSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = Field(default=True, description="1-worker CPU search trials train in warm hosts.")
    idle_s: float = Field(default=300.0, gt=0, description="A host idle this long exits.")


class Settings(BaseModel):
    """``GOVRAY_HOME/config.yaml``, with the environment's overrides applied."""

    model_config = _STRICT

    trust: Path | None = Field(
        default=None, description="The operator's trust file: the platform keys every verification accepts."
    )
    unsigned_policies: list[str] = Field(
        default_factory=list,
        description="Experiments that may run, and register runs, under a policy nobody signed (audited).",
    )
    store: StoreSettings = StoreSettings()
    timestamping: TimestampingSettings = TimestampingSettings()
    signer: SignerSettings = SignerSettings()
    serve: ServeSection = ServeSection()
    trial_hosts: TrialHostSettings = TrialHostSettings()
    cache: Path = Field(default=Path("~/.cache/govray"), description="This node's cache of object storage.")

    @property
    def cache_root(self) -> Path:
        return self.cache.expanduser()


# Environment variable → (section, setting); ``None``: a top-level setting.
OVERRIDES: dict[str, tuple[str | None, str]] = {
    "GOVRAY_DATABASE": ("store", "database_url"),
    "GOVRAY_TRUST": (None, "trust"),
    "GOVRAY_SERVE_TOKEN": ("serve", "token"),
    "GOVRAY_SERVE_HOST": ("serve", "host"),
    "GOVRAY_SERVE_PORT": ("serve", "port"),
    "GOVRAY_TSA_URL": ("timestamping", "url"),
    "GOVRAY_SIGNER_SOCKET": ("signer", "socket"),
    "GOVRAY_TRIAL_HOSTS": ("trial_hosts", "enabled"),
    "GOVRAY_TRIAL_HOST_IDLE_S": ("trial_hosts", "idle_s"),
    "GOVRAY_CACHE": (None, "cache"),
}


def settings_path(environ: Mapping[str, str] | None = None) -> Path:
    """``GOVRAY_HOME/config.yaml``."""
    return govray_home(environ) / SETTINGS_FILE


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings file (absent: every default), then each ``OVERRIDES`` variable that is set and
    not empty; ``ConfigError`` names the file or variable at fault. Read again only when the file
    or one of the variables changed (a worker asks at every object-storage open)."""
    environ = os.environ if environ is None else environ
    path = settings_path(environ)
    try:
        found = path.stat()
    except OSError:
        stamp: tuple[int, int] | None = None  # no file: every default
    else:
        stamp = (found.st_mtime_ns, found.st_size)
    return _loaded(str(path), stamp, tuple(environ.get(name, "") for name in OVERRIDES))


@functools.lru_cache(maxsize=16)
def _loaded(file: str, stamp: tuple[int, int] | None, variables: tuple[str, ...]) -> Settings:
    path = Path(file)
    values: dict[str, object] = {}
    if stamp is not None:
        text = read_text(path, ConfigError, "settings file")
        values = parse_yaml_mapping(text, file, ConfigError, "a settings file is a mapping")
    overridden = [(name, value) for name, value in zip(OVERRIDES, variables, strict=True) if value]
    for name, value in overridden:
        section, key = OVERRIDES[name]
        if section is None:
            values[key] = value
            continue
        inner = values.get(section) or {}
        if not isinstance(inner, dict):
            raise ConfigError(f"{path}: '{section}' is a mapping of settings")
        values[section] = {**inner, key: value}
    where = file if not overridden else f"{file} with {', '.join(name for name, _ in overridden)}"
    try:
        return Settings.model_validate(values)
    except ValidationError as error:
        raise ConfigError(f"settings from {where}: {describe_validation_error(error)}") from None


def operator_trust(
    environ: Mapping[str, str] | None = None, key: SigningKey | None = None, required: bool = True
) -> TrustConfig:
    """The operator's trust, the only one a checkpoint or an attestation is verified against: the
    platform key (``key``, the signer's own; by default this machine's public one: verifying reads
    no private key), and the platform keys and
    revocations of the settings' ``trust`` file. Never keys or revocations an experiment file, a
    run spec or a checkpoint carries: the engineer whose run is verified writes those (listing
    their own key there would launder their weights). No platform key anywhere is
    ``SignatureError`` naming ``govray keys init``, or, not ``required``, a trust of none."""
    configured = load_settings(environ).trust
    extra = load_trust(configured) if configured is not None else None
    platform = key.public_key if key is not None else platform_public_key()
    if platform is None and not any(k.role == KeyRole.PLATFORM for k in (extra.keys if extra else [])):
        if not required:  # (a policy check or an ingest verifies no checkpoint: it needs no key yet)
            return platform_trust(None, extra)
        held = platform_key_path().with_suffix(".pub")
        raise SignatureError(
            f"no platform key to verify against: neither this machine's ({held}: `govray keys init`) "
            "nor one in the settings' trust file"
        )
    return platform_trust(platform, extra)
