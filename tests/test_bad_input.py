"""No wrong answers under bad input: every identifier a user can send (model names, corpus ids,
ids, versions, tags, query parameters, JSON numbers) is checked where it enters — HTTP, CLI, the
registry's Python API — against a full-match pattern; a malformed one is a 4xx or a documented exit
code with a message, never a 5xx or a traceback, never normalised onto another id, and a refused
request writes nothing.

The HTTP properties run the lineage app in-process (``serve.app.create_app`` over a copy of the
golden run's store, the app ``govray serve`` deploys) so a few thousand requests take seconds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from sqlmodel import func, select

from govray.cli import main
from govray.config.serve import ServeSettings
from govray.core.identifiers import CORPUS_ID_BODY, MAX_ID, MODEL_NAME_BODY, IdentifierError, parse_model_ref
from govray.core.keys import load_trust, platform_key
from govray.platform.registry.register import register
from govray.platform.registry.versions import RegistryError
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import AttestationRecord, AuditEvent, ModelVersion, RegisteredModel
from serve.api import request_key
from serve.app import create_app
from tests.helpers.builders import REPO
from tests.helpers.golden import GoldenRun
from tests.helpers.lineage_server import copy_store

TOKEN = "bad-input-token"
MODELS = ("digits", "digits-2", "Digits")  # names that differ by a suffix or by case only
CORPORA = ("digits-public", "digits-licensed", "digits-writers")
BAD_NAMES = ("x:5", "digits\n", "digits\t", "dig\nits", "dig\x00its", "a" * 300, "digits ", "²")
WHITESPACE = ["\n", "\t", "\r", "\x00", " ", "\x0b", "\x0c", "\x1f", "\x7f", "\u00a0", "\u2028", "%"]
EXAMPLES = settings(
    max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@dataclass
class App:
    client: TestClient
    store: TrackingStore
    checkpoint: Path  # the golden trial's last checkpoint (in the copy)
    checkpoint_id: int
    trial_id: int
    experiment_id: int
    trust: Path


@pytest.fixture(scope="module")
def app(golden_run: GoldenRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    root = tmp_path_factory.mktemp("bad-input")
    store = copy_store(golden_run, root / "storage")
    trial_id = golden_run.outcome.trial_id
    final = checkpoints(store, trial_id)[-1]
    assert final.id is not None
    for name in MODELS:
        register(store, name, Path(final.path))
    trust = root / "trust.yaml"
    assert (
        main(["keys", "trust-platform", "--trust", str(trust), "--from", str(REPO / "policies/trust.yaml")])
        == 0
    )
    settings_ = ServeSettings(database_url=store.url, trust=trust, token=SecretStr(TOKEN))
    with TestClient(create_app(settings_), raise_server_exceptions=False) as client:
        yield App(
            client,
            store,
            Path(final.path),
            final.id,
            trial_id,
            store.get_trial(trial_id).experiment_id,
            trust,
        )
    store.close()


def row_counts(store: TrackingStore) -> tuple[int, ...]:
    with store.session() as session:
        return tuple(
            int(session.exec(select(func.count()).select_from(table)).one())
            for table in (RegisteredModel, ModelVersion, AttestationRecord, AuditEvent)
        )


def segment(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def near(known: tuple[str, ...]) -> st.SearchStrategy[str]:
    """A known id with whitespace or control characters put before, inside or after it — or any
    text at all."""
    spliced = st.builds(
        lambda base, extra, at: base[: at % (len(base) + 1)] + extra + base[at % (len(base) + 1) :],
        st.sampled_from(known),
        st.text(st.sampled_from(WHITESPACE), min_size=1, max_size=3),
        st.integers(0, 40),
    )
    return st.one_of(spliced, st.sampled_from(known), st.text(max_size=300))


NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from(
        ["1", "0", "-1", str(MAX_ID), str(MAX_ID + 1), "1e3", "²", "\uff11", "\u0663", "1 ", " 1", "0x1"]
    ),
    st.text(max_size=30),
)


def assert_answer(response: Any) -> None:
    """Not a 5xx, and a refusal says why."""
    assert response.status_code < 500, (response.request.url, response.status_code, response.text)
    if response.status_code >= 400 and response.headers["content-type"] == "application/json":
        assert response.json()["detail"], response.text


# --- HTTP: every path and query parameter, every body --------------------------------------------


@given(name=near(MODELS), version=NUMBERS, layer=st.one_of(st.none(), st.text(max_size=40)))
@EXAMPLES
def test_a_model_request_answers_only_about_the_exact_name_it_names(
    app: App, name: str, version: Any, layer: str | None
) -> None:
    listed = app.client.get(f"/api/models/{segment(name)}/versions")
    assert_answer(listed)
    if listed.status_code == 200:
        assert name in MODELS and {v["model_name"] for v in listed.json()["items"]} == {name}
    else:
        # an empty name, or one with a '/', is not one path segment: no route, a 404
        no_route = name == "" or "/" in name
        assert listed.status_code == (404 if no_route or re.fullmatch(MODEL_NAME_BODY, name) else 422)
    base = f"/api/models/{segment(name)}/versions/{segment(str(version))}"
    for path, params in ((base, {}), (f"{base}/lineage", {"layer": layer} if layer is not None else {})):
        answer = app.client.get(path, params=params, follow_redirects=False)  # '' + '/': a redirect
        assert_answer(answer)
        if answer.status_code == 200:
            body = answer.json()
            assert name in MODELS and str(version) == "1"  # not " 1", "01", "1\n" or a fullwidth 1
            assert (body.get("model") or body)["model_name"] == name


@given(corpus=near(CORPORA), row=NUMBERS, offset=NUMBERS, limit=NUMBERS)
@EXAMPLES
def test_a_corpus_request_answers_only_about_the_exact_corpus_it_names(
    app: App, corpus: str, row: Any, offset: Any, limit: Any
) -> None:
    influence = app.client.get(
        f"/api/corpora/{segment(corpus)}/influence", params={"offset": str(offset), "limit": str(limit)}
    )
    assert_answer(influence)
    if influence.status_code == 200:
        assert corpus in CORPORA
    elif influence.status_code == 404:
        assert (
            corpus == "" or "/" in corpus or (re.fullmatch(CORPUS_ID_BODY, corpus) and corpus not in CORPORA)
        )
    reach = app.client.get(f"/api/corpora/{segment(corpus)}/rows/{segment(str(row))}")
    assert_answer(reach)
    if reach.status_code == 200:
        assert corpus in CORPORA and reach.json()["corpus_id"] == corpus and reach.json()["row"] == int(row)


ID_PATHS = (
    "/api/experiments/{}",
    "/api/experiments/{}/trials",
    "/api/trials/{}",
    "/api/trials/{}/metrics",
    "/api/checkpoints/{}/lineage",
    "/api/checkpoints/{}/attestations",
    "/api/attestations/{}",
    "/lineage/models/digits/{}",
    "/lineage/checkpoints/{}",
)


@given(path=st.sampled_from(ID_PATHS), number=NUMBERS, query=st.dictionaries(st.text(max_size=12), NUMBERS))
@EXAMPLES
def test_an_id_request_is_about_that_id_or_refused(app: App, path: str, number: Any, query: Any) -> None:
    answer = app.client.get(path.format(segment(str(number))), params={k: str(v) for k, v in query.items()})
    assert_answer(answer)
    if answer.status_code == 200 and path.startswith("/api/") and path.count("/") == 3 and str(number):
        assert str(number).isascii() and answer.json().get("id", int(str(number))) == int(str(number))


AUDIT_PARAMS = ("experiment_id", "event_type", "since", "until", "offset", "limit")


@given(params=st.dictionaries(st.sampled_from(AUDIT_PARAMS), st.one_of(NUMBERS, st.text(max_size=40))))
@EXAMPLES
def test_the_audit_query_never_fails(app: App, params: dict[str, Any]) -> None:
    assert_answer(app.client.get("/api/audit", params={k: str(v) for k, v in params.items()}))


JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(2**80), 2**80),
        st.text(max_size=40),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)
VERIFY_FIELDS = ("envelope", "attestation_id", "checkpoint_id", "model")


@given(
    body=st.one_of(
        JSON,
        st.dictionaries(
            st.sampled_from(VERIFY_FIELDS), st.one_of(JSON, near(tuple(f"{m}:1" for m in MODELS)))
        ),
    )
)
@EXAMPLES
def test_verify_answers_any_json_body_without_a_server_error(app: App, body: Any) -> None:
    answer = app.client.post(
        "/api/verify", content=_json_text(body), headers={"Content-Type": "application/json"}
    )
    assert_answer(answer)


@pytest.mark.parametrize(
    "body",
    [
        '{"attestation_id": NaN}',
        '{"attestation_id": Infinity}',
        '{"attestation_id": 1e999}',
        '{"attestation_id": 99999999999999999999999}',
        '{"attestation_id": 1, "model": "digits:99999999999999999999"}',
        '{"attestation_id": 1, "model": "digits:\\u00b2"}',
        '{"attestation_id": 1, "model": "digits\\n:1"}',
    ],
)
def test_verify_refuses_non_finite_and_out_of_range_numbers_with_422(app: App, body: str) -> None:
    answer = app.client.post("/api/verify", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"]


@given(
    name=near(MODELS),
    body=st.one_of(
        JSON, st.fixed_dictionaries({"checkpoint_id": NUMBERS}, optional={"tags": JSON, "description": JSON})
    ),
)
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_writes_refuse_malformed_names_and_bodies_and_then_write_nothing(
    app: App, name: str, body: Any
) -> None:
    before = row_counts(app.store)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    made = app.client.post(f"/api/models/{segment(name)}/versions", content=_json_text(body), headers=headers)
    assert_answer(made)
    tagged = app.client.put(
        f"/api/models/{segment(name)}/versions/1/tags", content=_json_text({"tags": body}), headers=headers
    )
    assert_answer(tagged)
    if made.status_code != 201 and tagged.status_code != 200:
        assert row_counts(app.store) == before
    if name and "/" not in name and not re.fullmatch(MODEL_NAME_BODY, name):
        assert made.status_code == tagged.status_code == 422


def _json_text(value: Any) -> str:
    return json.dumps(value, allow_nan=True)  # NaN and Infinity too, as hostile clients send them


# --- the answer cache -----------------------------------------------------------------------------


def test_a_warm_cache_never_answers_another_names_request(app: App) -> None:
    warm = app.client.get("/api/models/digits/versions")
    assert warm.status_code == 200 and app.client.get("/api/models/digits/versions").json() == warm.json()
    for suffix in ("%0A", "%09", "%0D", "%00", "%20"):
        other = app.client.get(f"/api/models/digits{suffix}/versions")
        assert other.status_code == 422, (suffix, other.text)


def test_the_cache_key_is_the_raw_request() -> None:
    from starlette.requests import Request

    def key(path: str, raw: bytes, query: bytes = b"") -> bytes:
        scope = {
            "type": "http",
            "method": "GET",
            "path": path,
            "raw_path": raw,
            "query_string": query,
            "headers": [],
            "scheme": "http",
            "server": ("127.0.0.1", 80),
        }
        return request_key(Request(scope))

    plain = key("/api/models/x/versions", b"/api/models/x/versions")
    assert key("/api/models/x\n/versions", b"/api/models/x%0A/versions") != plain
    assert key("/api/models/x\t/versions", b"/api/models/x%09/versions") != plain
    assert key("/api/models/x/versions", b"/api/models/x/versions", b"limit=5") != plain


# --- the registry: every door refuses the same names, and writes nothing ---------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_registry_refuses_a_malformed_name_through_every_door_writing_nothing(
    app: App, name: str
) -> None:
    before = row_counts(app.store)
    with pytest.raises(RegistryError, match="model name"):
        register(app.store, name, app.checkpoint)
    assert row_counts(app.store) == before

    assert main(["model", "register", name, str(app.checkpoint), "--database", app.store.url]) == 17
    assert row_counts(app.store) == before

    headers = {"Authorization": f"Bearer {TOKEN}"}
    made = app.client.post(
        f"/api/models/{segment(name)}/versions", json={"checkpoint_id": app.checkpoint_id}, headers=headers
    )
    assert made.status_code == 422 and made.json()["detail"], made.text
    assert row_counts(app.store) == before


@pytest.mark.parametrize("tags", [{"ok": "a\x00b"}, {"bad\n": "x"}, {"a" * 200: "x"}, {"ok": "x" * 2000}])
def test_malformed_tags_and_descriptions_are_refused_before_anything_is_written(
    app: App, tags: dict[str, str]
) -> None:
    before = row_counts(app.store)
    with pytest.raises(RegistryError, match="tag"):
        register(app.store, "fresh-model", app.checkpoint, tags=tags)
    with pytest.raises(RegistryError, match="description"):
        register(app.store, "fresh-model", app.checkpoint, description="nul\x00inside")
    assert row_counts(app.store) == before


# --- the CLI: clear errors, documented exit codes, no traceback ------------------------------------


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["model", "describe", "digits:²"], 17, "expected a number from 1 to"),
        (["model", "describe", "digits:99999999999999999999999"], 17, "expected a number from 1 to"),
        (["model", "describe", "digits\n"], 17, "expected NAME or NAME:VERSION"),
        (["model", "versions", "digits\t"], 17, "model name"),
        (["model", "tag", "digits\n:1", "a=b"], 17, "expected NAME or NAME:VERSION"),
        (["experiment", "describe", "99999999999999999999999"], 8, "no experiment '99999999999999999999999'"),
        (["experiment", "describe", "digits\x00"], 2, "experiment (an id or a name)"),
        (["trial", "logs", "99999999999999999999999"], 2, "expected a number from 1 to"),
        (["trial", "logs", "\uff11"], 2, "expected a number from 1 to"),
        (["lineage", "row", "digits-public\n", "0"], 18, "corpus id"),
        (["lineage", "row", "digits-public", "99999999999999999999999"], 18, "expected a number from 0 to"),
    ],
)
def test_the_cli_refuses_malformed_identifiers_with_its_documented_exit_code(
    app: App, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, words: str
) -> None:
    assert main([*argv, "--database", app.store.url]) == code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_a_model_reference_is_parsed_exactly() -> None:
    assert parse_model_ref("digits") == ("digits", None)
    assert parse_model_ref("digits:12") == ("digits", 12)
    for ref in (
        "digits:",
        "digits:0",
        "digits:1\n",
        "digits\n",
        "digits:\u0661",
        f"digits:{MAX_ID + 1}",
        ":1",
        "a:b:c",
    ):
        with pytest.raises(IdentifierError):
            parse_model_ref(ref)


# --- the README's serve example verifies the demo's own attestations --------------------------------


def test_the_demo_trust_file_verifies_this_machines_attestations(app: App) -> None:
    trusted = {key.keyid for key in load_trust(app.trust).keys}
    assert platform_key().keyid in trusted
    assert trusted >= {key.keyid for key in load_trust(REPO / "policies/trust.yaml").keys}
    with app.store.session() as session:
        first = session.exec(select(AttestationRecord).order_by(AttestationRecord.id)).first()  # type: ignore[arg-type]
    assert first is not None
    answer = app.client.post("/api/verify", json={"attestation_id": first.id})
    assert answer.status_code == 200 and answer.json()["ok"] is True, answer.text
    readme = (REPO / "README.md").read_text()
    assert "--trust govray-storage/trust.yaml" in readme
    assert '"trust-platform"' in (REPO / "jobs/demo.py").read_text()
