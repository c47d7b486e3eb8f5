"""Ingest with Ray Data: exact counts, shards hold exactly their route's rows, deterministic
re-ingest, third-party fingerprints, and refusals that name corpus, row and field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from govray.config.experiment import load_experiment
from govray.core.errors import ConfigError, CredentialError, GovrayError, IngestError, PolicyError
from govray.core.keys import SigningKey
from govray.data.ingest import HOLDOUT, ingest
from govray.data.rowhash import row_hash
from govray.data.shards import ShardSet
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from tests.helpers.builders import (
    BASE_CREDENTIAL,
    table_rows,
    write_corpus,
)
from tests.helpers.ingest import LICENSES, build, corpus_spec, verified

pytestmark = pytest.mark.usefixtures("ray_session")


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
    (file,) = [file for file in result.manifest.route("licensed").files if file.corpus == "mixed"]
    table = pq.read_table(result.root / file.path).to_pylist()
    mixed = [row for row in table if row["_corpus"] == "mixed"]
    assert len(mixed) == len(table) == file.rows  # one file per (route, corpus, unit)
    assert mixed and all('"license_class":"licensed"' in row["_credential"] for row in mixed)
    # Format 4 stores each row's hash as its 32 raw bytes: the hash of the row's own columns.
    source = [{k: v for k, v in row.items() if not k.startswith("_")} for row in table]
    assert [row["_row_hash"].hex() for row in table] == [row_hash(row) for row in source]


# --- refusals: nothing starts, the message names the culprit, nothing is written --------------


def assert_refused(config_path: Path, error: type[GovrayError], message: str) -> str:
    """Ingest through preflight (as the CLI does): refused with ``message``; no shards, and
    nothing in the tracking store but the audit events of the refusal."""
    config = load_experiment(config_path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    with pytest.raises(error, match=message) as refused:
        ingest_experiment(config, checked, store)
    shards = Path(config.storage_path) / "shards"
    assert not list(shards.glob("*/manifest.json")), "a refused ingest must write no shards"
    assert rows_besides_the_audit_log(store) == {}, "a refused ingest leaves only audit events"
    events = AuditLog(store).list(event_type=AuditEventType.INGEST_REFUSED)
    assert len(events) == 1 and events[0].experiment_id is None
    assert json.loads(events[0].payload_json)["reason"] == str(refused.value)
    return str(refused.value)


def rows_besides_the_audit_log(store: TrackingStore) -> dict[str, int]:
    """Row counts of every non-empty table of the store but the audit log (and Alembic's own)."""
    counts = {}
    with store.engine.connect() as connection:
        for name in sa.inspect(connection).get_table_names():
            if name in ("audit_events", "alembic_version"):
                continue
            count = connection.execute(sa.select(sa.func.count()).select_from(sa.table(name))).scalar()
            if count:
                counts[name] = count
    return counts


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
    message = assert_refused(
        path,
        CredentialError,  # exit 3, as README's exit codes say for a bad credential
        r"corpus 'people' row 7: invalid credential: jurisdiction should match pattern",
    )
    # row 7 counts from 0; the header is line 1, so row 7 is line 9
    assert message.endswith(f"(at {tmp_path / 'c.csv'} row 7 (line 9))")


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
    message = assert_refused(
        path, CredentialError, r"corpus 'c' row 3: credential field 'sensitivity' \(column 'sens'\) is empty"
    )
    assert message.endswith(f"(at {tmp_path / 'c.jsonl'} row 3 (line 4))")


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
    assert_refused(path, PolicyError, r"corpus 'mix' \(row 4\) matches no rule in policy 'ingest-test' v1")


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
    assert_refused(path, CredentialError, r"corpus 'c': credential column\(s\) sens not in the data")


def test_empty_corpus_is_refused(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    write_corpus(tmp_path / "full.csv", table_rows(4))
    (tmp_path / "empty.csv").write_text("x,y,text\n")
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("full", "full.csv"), corpus_spec("hollow", "empty.csv")],
    )
    assert_refused(path, IngestError, r"corpus 'hollow' \(.*empty.csv\) is empty: it has no rows")


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
    with pytest.raises(PolicyError):  # exit 4: the row's credential matches no rule
        ingest_experiment(config, checked, store)
    events = AuditLog(store).list(event_type=AuditEventType.INGEST_REFUSED)
    assert len(events) == 1 and "corpus 'mix' (row 1)" in events[0].payload_json
    assert AuditLog(store).verify() == 2  # policy verified, ingest refused: no experiment created
    assert store.list_experiments() == []


def test_row_in_a_later_file_is_named_by_file_and_row(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    countries = ["DE"] * 6
    countries[4] = "Germany"
    write_corpus(tmp_path / "d" / "a.parquet", table_rows(5, country=["DE"] * 5))
    write_corpus(tmp_path / "d" / "b.parquet", table_rows(6, country=countries))
    path = build(
        tmp_path,
        authority_key,
        trust_file,
        [corpus_spec("p", "d", credential_columns={"jurisdiction": "country"})],
    )
    message = assert_refused(path, CredentialError, r"corpus 'p' row 9: invalid credential: jurisdiction")
    assert message.endswith(f"(at {tmp_path / 'd' / 'b.parquet'} row 4)")  # corpus row 9 = 5 + 4


# --- bad files: each refusal names the corpus, the file, and the row (from 0) and line (from 1) --


def refused_file(
    tmp_path: Path,
    authority_key: SigningKey,
    trust_file: Path,
    name: str,
    message: str,
    error: type[GovrayError] = IngestError,
) -> str:
    path = build(tmp_path, authority_key, trust_file, [corpus_spec("bad", name)])
    return assert_refused(path, error, message)


@pytest.mark.parametrize("name", ["empty.csv", "empty.jsonl", "empty.parquet"])
def test_zero_byte_file_is_refused_as_empty(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path, name: str
) -> None:
    (tmp_path / name).write_bytes(b"")
    refused_file(
        tmp_path, authority_key, trust_file, name, rf"^corpus 'bad': {tmp_path / name} is empty \(0 bytes\)$"
    )


def test_zero_byte_file_in_a_directory_is_named(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    write_corpus(tmp_path / "d" / "a.csv", table_rows(3))
    (tmp_path / "d" / "b.csv").write_bytes(b"")
    refused_file(
        tmp_path, authority_key, trust_file, "d", rf"corpus 'bad': {tmp_path / 'd' / 'b.csv'} is empty"
    )


def test_malformed_jsonl_line_is_named(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    lines = [json.dumps(row) for row in table_rows(5)]
    lines[3] = lines[3].replace(", ", " ", 1)  # a missing comma
    (tmp_path / "c.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")  # a blank line 2
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "c.jsonl",
        rf"^corpus 'bad': {tmp_path / 'c.jsonl'} row 3 \(line 5\): malformed JSON: Expecting ',' delimiter",
    )


def test_duplicate_json_key_is_refused_naming_key_and_line(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    lines = [json.dumps(row) for row in table_rows(4)]
    lines[2] = '{"x": 1.0, "y": 2, "text": "a", "y": 3}'
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "c.jsonl",
        rf"^corpus 'bad': {tmp_path / 'c.jsonl'} row 2 \(line 3\): key 'y' appears twice in the same object$",
    )


def test_duplicate_csv_header_is_refused_by_name(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    (tmp_path / "c.csv").write_text("x,y,text,y\n1,2,a,3\n")
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "c.csv",
        rf"^corpus 'bad': {tmp_path / 'c.csv'} \(line 1\): "
        r"the CSV header names column\(s\) 'y' more than once$",
    )


def test_duplicate_parquet_columns_are_refused_by_name(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    table = pa.Table.from_arrays(
        [pa.array([1.0, 2.0]), pa.array([1, 2]), pa.array([3, 4])], names=["x", "y", "y"]
    )
    pq.write_table(table, tmp_path / "c.parquet")
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "c.parquet",
        rf"^corpus 'bad': {tmp_path / 'c.parquet'}: the parquet schema names column\(s\) 'y' more than once$",
    )


def test_ragged_csv_row_is_named(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> None:
    (tmp_path / "c.csv").write_text("x,y,text\n1,2,a\n3,4,b\n5,6,c,extra\n")
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "c.csv",
        rf"^corpus 'bad': {tmp_path / 'c.csv'} row 2 \(line 4\): 4 fields, but the header has 3$",
    )


def test_directory_of_parquet_files_needs_no_format(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    write_corpus(tmp_path / "pub" / "a.parquet", table_rows(4))
    write_corpus(tmp_path / "pub" / "sub" / "b.parquet", table_rows(3, start=4))
    (tmp_path / "pub" / "_SUCCESS").write_text("")  # a writer's marker is not data
    path = build(tmp_path, authority_key, trust_file, [corpus_spec("pub", "pub")])
    config, policy = verified(path)
    manifest = ingest(config, policy).manifest
    assert manifest.corpus("pub").format == "parquet" and manifest.corpus("pub").rows == 7


def test_mixed_extensions_without_format_are_refused_naming_them(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    write_corpus(tmp_path / "mix" / "a.parquet", table_rows(4))
    write_corpus(tmp_path / "mix" / "b.csv", table_rows(3))
    write_corpus(tmp_path / "mix" / "c.csv", table_rows(3))
    refused_file(
        tmp_path,
        authority_key,
        trust_file,
        "mix",
        rf"^corpus 'bad': cannot tell the format of directory {tmp_path / 'mix'}: its files have "
        r"different or unknown extensions \(2 \.csv, 1 \.parquet\); set 'format'",
        ConfigError,  # exit 2: the experiment file must say which format to read
    )
