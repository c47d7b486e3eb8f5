"""Ingest with Ray Data: exact counts, shards hold exactly their route's rows, deterministic
re-ingest, third-party fingerprints, and refusals that name corpus, row and field."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from govray.config import load_experiment
from govray.data.ingest import HOLDOUT, ingest
from govray.data.shards import ShardSet
from govray.errors import ConfigError, GovrayError, IngestError
from govray.keys import SigningKey, load_trust
from govray.policy import VerifiedPolicy, load_verified_policy
from govray.preflight import check_policy, ingest_experiment
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from tests.conftest import BASE_CREDENTIAL, table_rows, write_corpus, write_experiment, write_signed_policy

pytestmark = pytest.mark.usefixtures("ray_session")

POLICY: dict[str, Any] = {
    "name": "ingest-test",
    "version": 1,
    "adapters": {"pii-lora": {"targets": ["hidden"]}},
    "rules": [
        {"name": "public", "match": {"license_class": "public-domain"}, "route": "all"},
        {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -1}}},
        {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"adapter": "pii-lora"}},
    ],
}
LICENSES = ["public-domain", "licensed", "proprietary"]


def corpus_spec(corpus_id: str, path: str, **extra: Any) -> dict[str, Any]:
    return {"id": corpus_id, "path": path, "credential": dict(BASE_CREDENTIAL), **extra}


def build(
    tmp_path: Path, key: SigningKey, trust_file: Path, corpora: list[dict[str, Any]], **overrides: Any
) -> Path:
    write_signed_policy(tmp_path, POLICY, key)
    return write_experiment(tmp_path, data={"holdout_fraction": 0.25, "corpora": corpora}, **overrides)


def verified(config_path: Path) -> tuple[Any, VerifiedPolicy]:
    config = load_experiment(config_path)
    assert config.policy.trust is not None
    return config, load_verified_policy(
        config.policy.file, config.policy.signature_path, load_trust(config.policy.trust)
    )


@pytest.fixture
def three_corpora(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> Path:
    """A parquet directory of two files, a jsonl file, and a csv with per-row license and sensitivity."""
    write_corpus(tmp_path / "pub" / "b.parquet", table_rows(30, start=100))
    write_corpus(tmp_path / "pub" / "a.parquet", table_rows(40))
    write_corpus(tmp_path / "lic.jsonl", table_rows(50, start=500))
    mixed = table_rows(
        61,
        start=900,
        lic=[LICENSES[i % 3] for i in range(61)],
        sens=["pii" if i % 3 == 2 or i % 5 == 0 else "public" for i in range(61)],
    )
    write_corpus(tmp_path / "mixed.csv", mixed)
    licensed = {**BASE_CREDENTIAL, "license_class": "licensed"}
    return build(
        tmp_path,
        authority_key,
        trust_file,
        [
            corpus_spec("pub", "pub", format="parquet"),
            {"id": "lic", "path": "lic.jsonl", "credential": licensed},
            corpus_spec(
                "mixed", "mixed.csv", credential_columns={"license_class": "lic", "sensitivity": "sens"}
            ),
        ],
    )


def expected_route(row: dict[str, Any], corpus: str) -> str:
    if corpus == "pub":
        return "public"
    if corpus == "lic":
        return "licensed"
    # mixed: first match wins; public-domain and licensed rules come before the pii rule,
    # so only proprietary rows (all pii) take the adapter route.
    return {"public-domain": "public", "licensed": "licensed", "proprietary": "pii"}[row["lic"]]


def test_counts_splits_and_shards_are_exact(three_corpora: Path) -> None:
    config, policy = verified(three_corpora)
    result = ingest(config, policy)
    manifest = result.manifest
    assert [(c.corpus_id, c.rows) for c in manifest.corpora] == [("pub", 70), ("lic", 50), ("mixed", 61)]
    for corpus in manifest.corpora:
        assert corpus.train_rows + corpus.holdout_rows == corpus.rows
        assert sum(corpus.route_counts.values()) == corpus.train_rows
        assert 0 < corpus.holdout_rows < corpus.rows  # holdout_fraction 0.25 of 50-70 rows
    shards = ShardSet.open(result.root, verify=True)
    sources = {
        "pub": table_rows(40) + table_rows(30, start=100),  # a.parquet sorts before b.parquet
        "lic": table_rows(50, start=500),
        "mixed": [{**row, "lic": LICENSES[i % 3]} for i, row in enumerate(table_rows(61, start=900))],
    }
    seen: dict[tuple[str, int], str] = {}
    for route in manifest.routes:
        table = shards.route_table(route.route).to_pylist()
        assert len(table) == route.rows == sum(route.corpus_counts.values())
        for row in table:
            source = sources[row["_corpus"]][row["_row"]]
            assert row["x"] == source["x"] and row["text"] == source["text"]  # row numbers are right
            assert row["_route"] == route.route == expected_route(source, row["_corpus"])
            assert (row["_corpus"], row["_row"]) not in seen
            seen[(row["_corpus"], row["_row"])] = route.route
    for corpus in manifest.corpora:
        holdout = shards.holdout_table(corpus.corpus_id).to_pylist()
        assert len(holdout) == corpus.holdout_rows
        assert all(row["_route"] == HOLDOUT for row in holdout)
        for row in holdout:
            assert (row["_corpus"], row["_row"]) not in seen
            seen[(row["_corpus"], row["_row"])] = HOLDOUT
    # Every source row exactly once, in training or holdout.
    assert set(seen) == {(corpus, index) for corpus, rows in sources.items() for index in range(len(rows))}
    # Rows 0 and 10 are pii too, but the public-domain and licensed rules match them first.
    assert manifest.route("pii").corpus_counts == {"mixed": manifest.corpus("mixed").route_counts["pii"]}
    assert seen[("mixed", 0)] in ("public", HOLDOUT) and seen[("mixed", 10)] in ("licensed", HOLDOUT)


def test_reingest_is_byte_identical(three_corpora: Path, tmp_path: Path) -> None:
    config, policy = verified(three_corpora)
    first = ingest(config, policy)

    def digests(root: Path) -> dict[str, str]:
        return {
            str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*"))
            if path.is_file()
        }

    before = digests(first.root)
    again = ingest(config, policy, force=True)
    assert again.root == first.root and not again.reused
    assert digests(again.root) == before
    reused = ingest(config, policy)
    assert reused.reused and digests(reused.root) == before
    elsewhere = ingest(config.model_copy(update={"storage_path": str(tmp_path / "other")}), policy)
    assert digests(elsewhere.root) == before


def independent_fingerprint(root: Path) -> str:
    """The documented definition, written again from scratch."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name if root.is_file() else p.relative_to(root).as_posix()):
        relative = path.name if root.is_file() else path.relative_to(root).as_posix()
        data = path.read_bytes()
        h.update(relative.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def test_fingerprint_is_recomputable_by_a_third_party(three_corpora: Path, tmp_path: Path) -> None:
    config, policy = verified(three_corpora)
    manifest = ingest(config, policy).manifest
    assert manifest.corpus("pub").fingerprint == independent_fingerprint(tmp_path / "pub")
    assert manifest.corpus("lic").fingerprint == independent_fingerprint(tmp_path / "lic.jsonl")
    assert manifest.corpus("mixed").fingerprint == independent_fingerprint(tmp_path / "mixed.csv")


def test_shards_keep_the_row_credential_and_hash(three_corpora: Path) -> None:
    config, policy = verified(three_corpora)
    result = ingest(config, policy)
    table = pq.read_table(result.root / result.manifest.route("licensed").files[0].path).to_pylist()
    mixed = [row for row in table if row["_corpus"] == "mixed"]
    assert mixed and all('"license_class":"licensed"' in row["_credential"] for row in mixed)
    assert all(len(row["_row_hash"]) == 64 for row in table)


# --- refusals: nothing starts, the message names the culprit, nothing is written --------------


def assert_refused(config_path: Path, error: type[GovrayError], message: str) -> None:
    config, policy = verified(config_path)
    with pytest.raises(error, match=message):
        ingest(config, policy)
    shards = Path(config.storage_path) / "shards"
    assert not list(shards.glob("*/manifest.json")), "a refused ingest must write no shards"


def test_bad_row_credential_names_corpus_row_and_field(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    countries = ["DE"] * 12
    countries[7] = "Germany"
    write_corpus(tmp_path / "c.csv", table_rows(12, country=countries))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("people", "c.csv", credential_columns={"jurisdiction": "country"})],
    )
    assert_refused(
        path,
        IngestError,
        r"corpus 'people' row 7: invalid credential: jurisdiction: String should match pattern",
    )


def test_empty_credential_cell_names_the_column(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    sensitivity: list[Any] = ["public"] * 5
    sensitivity[3] = None
    write_corpus(tmp_path / "c.jsonl", table_rows(5, sens=sensitivity))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("c", "c.jsonl", credential_columns={"sensitivity": "sens"})],
    )
    assert_refused(
        path, IngestError, r"corpus 'c' row 3: credential field 'sensitivity' \(column 'sens'\) is empty"
    )


def test_row_matching_no_rule_is_refused(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    licenses = ["public-domain"] * 9
    licenses[4] = "copyleft"
    write_corpus(tmp_path / "c.csv", table_rows(9, lic=licenses))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("mix", "c.csv", credential_columns={"license_class": "lic"})],
    )
    assert_refused(path, IngestError, r"corpus 'mix' \(row 4\) matches no rule in policy 'ingest-test' v1")


def test_missing_credential_column_is_refused(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    write_corpus(tmp_path / "c.parquet", table_rows(4))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("c", "c.parquet", credential_columns={"sensitivity": "sens"})],
    )
    assert_refused(path, IngestError, r"corpus 'c': credential column\(s\) sens not in the data")


def test_empty_corpus_is_refused(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    write_corpus(tmp_path / "full.csv", table_rows(4))
    (tmp_path / "empty.csv").write_text("x,y,text\n")
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("full", "full.csv"), corpus_spec("hollow", "empty.csv")],
    )
    assert_refused(path, IngestError, r"corpus 'hollow' \(.*empty.csv\) is empty")


def test_missing_path_is_refused(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    path = build(tmp_path, authority_key, trust_file, [corpus_spec("ghost", "nowhere.parquet")])
    assert_refused(path, IngestError, r"corpus 'ghost': path .*nowhere.parquet does not exist")


def test_duplicated_corpus_id_is_refused(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    write_corpus(tmp_path / "c.csv", table_rows(4))
    path = build(
        tmp_path, authority_key, trust_file, [corpus_spec("twice", "c.csv"), corpus_spec("twice", "c.csv")]
    )
    with pytest.raises(
        ConfigError, match=r"experiment.yaml: data.corpora: .*corpus id 'twice' appears more than once"
    ):
        load_experiment(path)


def test_refused_ingest_is_in_the_audit_log(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    licenses = ["public-domain", "copyleft"]
    write_corpus(tmp_path / "c.csv", table_rows(2, lic=licenses))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("mix", "c.csv", credential_columns={"license_class": "lic"})],
    )
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    with pytest.raises(IngestError):
        ingest_experiment(config, checked, store)
    events = AuditLog(store).list(event_type=AuditEventType.INGEST_REFUSED)
    assert len(events) == 1 and "corpus 'mix' (row 1)" in events[0].payload_json
    assert AuditLog(store).verify() == 3  # policy verified, experiment created, ingest refused
