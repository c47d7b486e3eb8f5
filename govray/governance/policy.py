"""Signed depth policies: which parameters each credential's gradients may update.

A policy is an ordered list of rules. A rule matches credential fields and names a route:

- ``all`` — every parameter of the base model;
- ``{params: [GLOB, ...], depth: {min: I, max: J}}`` — parameters whose names match a glob and/or
  that lie in layers ``I..J`` (inclusive, 0-based over the trial's ordered layers; negative
  indexes count from the top, ``-1`` is the last layer); the two select a union;
- ``{adapter: NAME}`` — only the removable adapter ``NAME`` declared under ``adapters``.

First match wins; a credential that matches no rule is refused unless ``default`` names a route.
The policy file is signed by the policy authority as a DSSE envelope (``POLICY.sig``) whose
payload names the policy and the sha256 of its bytes, so any edit to the file breaks it.

Example::

    name: digits
    version: 3
    adapters:
      pii-lora: {targets: [hidden], rank: 4, alpha: 8}
    rules:
      - {name: public,   match: {license_class: [public-domain, permissive]}, route: all}
      - {name: licensed, match: {license_class: licensed}, route: {depth: {min: -2}}}
      - {name: pii,      match: {sensitivity: pii}, route: {adapter: pii-lora}}
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import json
from pathlib import Path
from typing import Annotated, Any, Literal

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

from govray.core.canonical import file_sha256
from govray.core.dsse import Envelope, read_envelope, sign_envelope, signing_time, verify_envelope
from govray.core.errors import PolicyError, SignatureError, describe_validation_error
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.core.yaml_files import parse_yaml_mapping, read_text
from govray.governance.credentials import MATCHABLE_FIELDS, Credential
from govray.governance.memorization_thresholds import MemorizationThresholds

POLICY_SIGNATURE_TYPE = "application/vnd.govray.policy-signature+json"
POLICY_SIGNATURE_PREDICATE = "https://govray.dev/PolicySignature/v1"
DEFAULT_ROUTE = "default"

_FIELD_TYPES: dict[str, Any] = {name: Credential.model_fields[name].annotation for name in MATCHABLE_FIELDS}


class DepthRange(BaseModel):
    """Layers ``min..max`` inclusive; negative indexes count from the top. Omitted ends are open."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int | None = None
    max: int | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> DepthRange:
        if self.min is None and self.max is None:
            raise ValueError("a depth range needs min and/or max")
        return self


class LayerRoute(BaseModel):
    """Parameters matching any of ``params`` (globs) or lying in the ``depth`` range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: tuple[str, ...] = ()
    depth: DepthRange | None = None

    @model_validator(mode="after")
    def _selects_something(self) -> LayerRoute:
        if not self.params and self.depth is None:
            raise ValueError("a layer route needs 'params' globs and/or a 'depth' range")
        return self


class AdapterRoute(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter: str


Route = Literal["all"] | LayerRoute | AdapterRoute


class AdapterSpec(BaseModel):
    """A removable LoRA adapter (PEFT's) on the modules whose names match ``targets`` (globs):
    ``nn.Linear``, ``nn.Embedding`` or transformers' ``Conv1D``; ``dropout`` on the adapter's
    input (0: none). Left at 0, ``dropout`` is not serialized, so a policy or run spec written
    before it existed keeps its bytes and digest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lora"] = "lora"
    targets: tuple[str, ...] = Field(min_length=1)
    rank: int = Field(default=4, ge=1)
    alpha: float = Field(default=8.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @model_serializer(mode="wrap")
    def _without_default_dropout(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        if self.dropout == 0.0:
            dumped.pop("dropout", None)
        return dumped


MatchValue = str | bool | list[str] | list[bool]


class Rule(BaseModel):
    """Credentials whose fields equal ``match`` (any listed value per field) take ``route``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    match: dict[str, MatchValue] = Field(default_factory=dict)
    route: Annotated[Route, Field()]

    @field_validator("match")
    @classmethod
    def _known_fields(cls, match: dict[str, MatchValue]) -> dict[str, MatchValue]:
        for field, value in match.items():
            if field not in MATCHABLE_FIELDS:
                raise ValueError(
                    f"cannot match on '{field}' (credential fields: {', '.join(MATCHABLE_FIELDS)})"
                )
            values = value if isinstance(value, list) else [value]
            if not values:
                raise ValueError(f"'{field}' lists no values")
            if field == "corpus_id":
                continue  # corpus ids match as globs
            kind = _FIELD_TYPES[field]
            for item in values:
                try:
                    kind(item)
                except ValueError:
                    raise ValueError(f"'{item}' is not a valid {field}") from None
        return match

    def matches(self, credential: Credential) -> bool:
        return not self.mismatches(credential)

    def mismatches(self, credential: Credential) -> list[str]:
        """The fields of ``match`` that ``credential`` does not meet, each said as ``FIELD: 'VALUE'
        is not one of A, B`` (empty: the rule matches)."""
        found = []
        for field, wanted in self.match.items():
            values = wanted if isinstance(wanted, list) else [wanted]
            actual = credential.field_value(field)
            if field == "corpus_id":
                met = any(fnmatch.fnmatchcase(actual, str(pattern)) for pattern in values)
            else:
                met = any(_same(actual, item) for item in values)
            if not met:
                found.append(f"{field}: {actual!r} is not one of {', '.join(str(v) for v in values)}")
        return found


def _same(actual: Any, wanted: Any) -> bool:
    if isinstance(actual, bool) or isinstance(wanted, bool):
        return actual is wanted or actual == wanted
    return str(actual) == str(wanted)


class DepthPolicy(BaseModel):
    """An ordered, versioned list of rules mapping credentials to routes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    version: int = Field(ge=1)
    description: str = ""
    adapters: dict[str, AdapterSpec] = Field(default_factory=dict)
    rules: list[Rule] = Field(min_length=1)
    default: Route | None = None
    # What counts as memorizing, and what a flag does (flag / gate / rollback); None: the defaults.
    memorization: MemorizationThresholds | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DepthPolicy:
        names = [rule.name for rule in self.rules]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"rule names must be unique: {', '.join(duplicates)}")
        if DEFAULT_ROUTE in names:
            raise ValueError(f"'{DEFAULT_ROUTE}' is reserved for the policy's default route")
        for key, route in self.routes().items():
            if isinstance(route, AdapterRoute) and route.adapter not in self.adapters:
                raise ValueError(
                    f"route '{key}' names adapter '{route.adapter}', not declared under 'adapters'"
                )
        return self

    def routes(self) -> dict[str, Route]:
        """Route key → route, in rule order; the default route (if any) last, keyed 'default'."""
        routes: dict[str, Route] = {rule.name: rule.route for rule in self.rules}
        if self.default is not None:
            routes[DEFAULT_ROUTE] = self.default
        return routes

    def route_key_for(self, credential: Credential, *, where: str = "") -> str:
        """The key of the first rule matching ``credential`` (or 'default'), else ``PolicyError``.

        ``where`` is added after the corpus name in the error, e.g. ``" (row 17)"``.
        """
        for rule in self.rules:
            if rule.matches(credential):
                return rule.name
        if self.default is not None:
            return DEFAULT_ROUTE
        raise PolicyError(
            f"corpus '{credential.corpus_id}'{where} matches no rule in policy '{self.name}' "
            f"v{self.version}{self.closest_rule(credential)}"
        )

    def closest_rule(self, credential: Credential) -> str:
        """What to say of a credential no rule matches: the rule it misses by the fewest fields
        (of those, the one it meets in the most; then the first), what it misses, and how to let it
        in."""
        if not self.rules:
            return "; the policy has no rule: add one, or a default route"
        scores = []
        for index, rule in enumerate(self.rules):
            missed = len(rule.mismatches(credential))
            scores.append((missed, -(len(rule.match) - missed), index))
        closest = self.rules[min(scores)[2]]
        return (
            f"; closest rule '{closest.name}' ({'; '.join(closest.mismatches(credential))}): widen its "
            "match, add a rule for this credential, or give the policy a default route"
        )

    @property
    def restricts(self) -> bool:
        """True when some route updates less than every base parameter."""
        return any(route != "all" for route in self.routes().values())


def parse_policy(text: str, *, source: str) -> DepthPolicy:
    raw = parse_yaml_mapping(
        text, source, PolicyError, "a policy is a mapping with 'name', 'version' and 'rules'"
    )
    for index, rule in enumerate(raw.get("rules") or []):
        if isinstance(rule, dict) and "route" not in rule:
            name = rule.get("name", f"#{index}")
            raise PolicyError(f"{source}: rule '{name}' (rules.{index}) has no route")
    try:
        return DepthPolicy.model_validate(raw)
    except ValidationError as error:
        raise PolicyError(f"{source}: invalid policy: {describe_validation_error(error)}") from None


def load_policy(path: Path) -> DepthPolicy:
    return parse_policy(read_text(path, PolicyError, "policy"), source=str(path))


class PolicySignature(BaseModel):
    """The signed statement: this policy file (by digest) is approved by the policy authority."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type_: str = Field(default=POLICY_SIGNATURE_PREDICATE, alias="_type")
    policy_name: str
    policy_version: int
    policy_sha256: str
    signed_at: dt.datetime
    keyid: str = ""  # filled in on verification; not part of the signed payload

    def payload(self) -> bytes:
        body = self.model_dump(mode="json", by_alias=True, exclude={"keyid"})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


UNSIGNED_POLICY = "unsigned"  # who signed a policy nobody signed (a run the operator let through)


class VerifiedPolicy(BaseModel):
    """A loaded policy with its digest and how it was authorised."""

    model_config = ConfigDict(frozen=True)

    policy: DepthPolicy
    digest: str
    path: str
    signature: PolicySignature | None  # None: run with --allow-unsigned-policy


def sign_policy(path: Path, key: SigningKey) -> Envelope:
    """Sign the policy at ``path`` with a policy-authority key."""
    if key.role != KeyRole.POLICY_AUTHORITY:
        raise SignatureError(
            f"key {key.keyid} is a {key.role.value} key; policies need a policy-authority key"
        )
    policy = load_policy(path)
    statement = PolicySignature(
        policy_name=policy.name,
        policy_version=policy.version,
        policy_sha256=file_sha256(path),
        signed_at=signing_time(),
    )
    return sign_envelope(statement.payload(), POLICY_SIGNATURE_TYPE, key, statement.signed_at)


def load_verified_policy(
    path: Path, signature_path: Path | None, trust: TrustConfig | None, *, allow_unsigned: bool = False
) -> VerifiedPolicy:
    """Load a policy and check its signature; refuse unsigned unless ``allow_unsigned``.

    The caller records an unsigned run in the audit log (``VerifiedPolicy.signature is None``).
    """
    policy = load_policy(path)
    digest = file_sha256(path)
    if signature_path is None or not signature_path.exists():
        if allow_unsigned:
            return VerifiedPolicy(policy=policy, digest=digest, path=str(path), signature=None)
        missing = f" ({signature_path} does not exist)" if signature_path else ""
        raise SignatureError(
            f"policy '{policy.name}' v{policy.version} ({path}) is unsigned{missing}; sign it with "
            "'govray policy sign' or pass --allow-unsigned-policy (recorded in the audit log)"
        )
    if trust is None:
        raise SignatureError(f"policy {path}: a trust file is needed to verify its signature")
    what = f"signature {signature_path} of policy '{policy.name}' v{policy.version}"
    payload, signer = verify_envelope(
        read_envelope(signature_path),
        trust,
        KeyRole.POLICY_AUTHORITY,
        expected_type=POLICY_SIGNATURE_TYPE,
        what=what,
    )
    try:
        statement = PolicySignature.model_validate_json(payload)
    except ValidationError as error:
        raise SignatureError(f"{what}: malformed payload: {describe_validation_error(error)}") from None
    if statement.policy_sha256 != digest:
        raise SignatureError(
            f"policy file {path} (sha256 {digest[:16]}…) does not match its signature "
            f"(signed sha256 {statement.policy_sha256[:16]}…): the policy was modified after signing"
        )
    return VerifiedPolicy(
        policy=policy,
        digest=digest,
        path=str(path),
        signature=statement.model_copy(update={"keyid": signer}),
    )
