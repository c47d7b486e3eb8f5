"""The EU AI Act training-content summary: built from the credentials and
the ledger, every corpus listed with its credential and the examples that reached the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from govray.cli import main
from govray.cli.export import to_markdown
from govray.data.shards import ShardSet
from govray.governance.memorization_thresholds import MemorizationThresholds
from govray.platform.registry.register import register, remove_adapter
from govray.provenance.eu_summary import EuSummary, eu_summary
from govray.tracking.lineage import ledger_rows
from govray.tracking.tables import CorpusRecord
from govray.train.checkpoints.files import STATE_FILE, CheckpointState, find_checkpoints
from govray.train.step.ledger import Ledger
from tests.helpers.golden import GoldenRun

WRITERS = "digits-writers"  # PII, TDM opt-out, routed to the removable adapter pii-lora


def final_checkpoint(golden: GoldenRun) -> Path:
    return find_checkpoints(golden.outcome.run_dir)[-1]


def corpus_records(golden: GoldenRun) -> dict[str, CorpusRecord]:
    experiment = golden.store.get_trial(golden.outcome.trial_id).experiment_id
    return {record.corpus_id: record for record in golden.store.list_corpora(experiment)}


def ledger_examples(golden: GoldenRun) -> dict[str, int]:
    """Examples per corpus in the final checkpoint's ledger, checked against the tracking store's
    ledger rows (each digits corpus trains one route, so every tensor it reached counts them all)."""
    state = CheckpointState.model_validate_json((final_checkpoint(golden) / STATE_FILE).read_text())
    ledger = Ledger.from_json(state.ledger)
    examples = {
        corpus: max(entry.examples for c, _, entry in ledger.rows() if c == corpus)
        for corpus in ledger.corpora()
    }
    stored = ledger_rows(golden.store, golden.outcome.trial_id)
    assert examples == {
        c: max(r.examples for r in stored if r.corpus_id == c) for c in {r.corpus_id for r in stored}
    }
    return examples


def row_credentials(golden: GoldenRun, corpus_id: str, field: str) -> list[str]:
    """The values of a credential field over every row of a corpus, as the ingest wrote them."""
    shards = ShardSet.open(golden.shard_root)
    values = set()
    tables = [
        shards.route_table(r.route, ["_corpus", "_credential"]) for r in shards.manifest.routes if r.rows
    ]
    tables.append(shards.holdout_table(corpus_id, ["_corpus", "_credential"]))
    for table in tables:
        for corpus, text in zip(
            table.column("_corpus").to_pylist(), table.column("_credential").to_pylist(), strict=True
        ):
            if corpus == corpus_id:
                values.add(json.loads(text)[field])
    return sorted(values)


def test_the_eu_summary_of_the_demo_model_lists_every_corpus_with_its_credential_and_example_count(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    records = corpus_records(golden_run)
    examples = ledger_examples(golden_run)
    trial = golden_run.store.get_trial(golden_run.outcome.trial_id)
    summary = eu_summary(final_checkpoint(golden_run), model="digits", version="1", trial=trial)

    listed = {c.corpus_id: (group, c) for group in summary.sources for c in group.corpora}
    assert sorted(listed) == sorted(records) == ["digits-licensed", "digits-public", WRITERS]
    for corpus_id, record in records.items():
        group, source = listed[corpus_id]
        credential = json.loads(record.credential_json)
        assert group.source_type == source.source_type == credential["source_type"]
        assert source.credential == credential
        for field in ("license_class", "modality", "tdm_opt_out", "provider"):
            assert getattr(source, field) == credential.get(field), (corpus_id, field)
        assert source.collection_period.model_dump() == credential["collection_period"]
        # Per-row fields (the writers' jurisdiction and sensitivity) as found in the rows.
        assert source.jurisdictions == row_credentials(golden_run, corpus_id, "jurisdiction")
        assert source.sensitivities == row_credentials(golden_run, corpus_id, "sensitivity")
        assert (source.fingerprint, source.rows, source.train_rows, source.holdout_rows) == (
            record.fingerprint,
            record.rows,
            record.train_rows,
            record.holdout_rows,
        )
        assert source.route_rows == json.loads(record.route_counts_json)
        assert source.examples == source.trained_examples == examples[corpus_id] > 0
        assert source.excluded == ""
    assert summary.general.examples == sum(examples.values())
    assert summary.general.rows == sum(record.rows for record in records.values())
    assert summary.general.modalities == ["image"] and summary.general.adapters == ["pii-lora"]
    assert summary.general.policy == "digits v1" and summary.general.step == 30
    assert summary.general.training_period is not None
    crawled = next(group for group in summary.sources if group.source_type == "crawled")
    assert crawled.corpora == [] and crawled.domains == {}

    (opt_out,) = summary.processing.tdm_opt_outs
    assert (opt_out.corpus_id, opt_out.examples, opt_out.honoured) == (WRITERS, examples[WRITERS], False)
    assert "only the removable adapter pii-lora" in opt_out.how
    pii = [s for s in summary.processing.sensitive_data if s.sensitivity == "pii"]
    assert [(s.corpus_id, s.route, s.updates, s.rows, s.in_model) for s in pii] == [
        (WRITERS, "pii", "only the removable adapter pii-lora", records[WRITERS].train_rows, True)
    ]
    assert summary.processing.excluded_corpora == {}
    # The last validation's memorization checks: every detector that ran, with its value and the
    # policy's threshold (the defaults here), as the checkpoint's report holds them.
    state = CheckpointState.model_validate_json((final_checkpoint(golden_run) / STATE_FILE).read_text())
    report = state.memorization
    checks = {check.corpus_id: check for check in summary.processing.memorization}
    assert sorted(checks) == sorted(report["corpora"])
    for corpus_id, check in checks.items():
        ran = {k: v for k, v in report["corpora"][corpus_id]["measures"].items() if v is not None}
        assert check.measures == ran and {"loss_gap", "min_k_prob", "confidence_gap"} <= set(ran)
        assert check.thresholds["confidence_gap"] == MemorizationThresholds().confidence_gap
        assert check.flagged == report["corpora"][corpus_id]["flagged"]

    markdown = to_markdown(summary)
    for heading in ("## 1. General information", "## 2. List of data sources", "## 3. Data processing"):
        assert heading in markdown
    for corpus_id, (_, source) in listed.items():
        (line,) = [line for line in markdown.splitlines() if line.startswith(f"| {corpus_id} |")]
        assert line.endswith(f"| {source.rows} | {examples[corpus_id]} |")
        assert f"| {source.license_class} |" in line

    url = golden_run.config.database_url
    command = ["export", "eu-summary", "--checkpoint", str(final_checkpoint(golden_run)), "--database", url]
    assert main([*command, "--format", "json"]) == 0
    printed = EuSummary.model_validate_json(capsys.readouterr().out)
    assert printed.sources == summary.sources and printed.processing == summary.processing
    assert main([*command, "--format", "md"]) == 0
    assert capsys.readouterr().out.strip() == to_markdown(printed).strip()


def test_the_summary_of_a_version_without_the_pii_adapter_excludes_the_writers(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    store, url = golden_run.store, golden_run.config.database_url
    examples = ledger_examples(golden_run)
    version = register(store, "eu-summary-demo", final_checkpoint(golden_run))
    clean = remove_adapter(store, version.ref, "pii-lora")
    assert main(["export", "eu-summary", clean.ref, "--format", "json", "--database", url]) == 0
    summary = EuSummary.model_validate_json(capsys.readouterr().out)

    assert (summary.general.model, summary.general.version, summary.general.adapters) == (
        "eu-summary-demo",
        str(clean.version),
        [],
    )
    sources = {c.corpus_id: c for group in summary.sources for c in group.corpora}
    assert {c: s.examples for c, s in sources.items()} == {**examples, WRITERS: 0}
    assert sources[WRITERS].trained_examples == examples[WRITERS]
    assert "lacks the adapter" in sources[WRITERS].excluded
    assert list(summary.processing.excluded_corpora) == [WRITERS] == list(clean.excluded_corpora)
    (opt_out,) = summary.processing.tdm_opt_outs
    assert opt_out.honoured and opt_out.examples == 0
    assert [s.in_model for s in summary.processing.sensitive_data if s.corpus_id == WRITERS] == [False]
    assert summary.general.examples == sum(examples.values()) - examples[WRITERS]


def test_an_unknown_model_or_a_missing_checkpoint_is_refused_with_its_exit_code(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    url = golden_run.config.database_url
    assert main(["export", "eu-summary", "no-such-model:3", "--database", url]) == 17
    assert "no registered model 'no-such-model'" in capsys.readouterr().err
    assert main(["export", "eu-summary", "--database", url]) == 2  # neither a model nor --checkpoint
    assert main(["export", "eu-summary", "--checkpoint", "/no/such/checkpoint"]) == 19
    assert "/no/such/checkpoint: no such checkpoint" in capsys.readouterr().err
