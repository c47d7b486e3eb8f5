"""The lineage page: server-rendered HTML for a reviewer, on the same app as the JSON API.

- ``GET /lineage``: the index, linking each model version and checkpoint to its page;
- ``GET /lineage/models/{name}/{version}`` and ``GET /lineage/checkpoints/{id}``: the layers x
  corpora matrix (examples that directly reached each layer) under each corpus's credential, the
  policy and its rules, the memorization report and the attestation's verification status.

Plain HTML with inline CSS (no script, no external asset: it works on a closed network and in a
headless browser). Every value is escaped. Elements tests and scrapers can rely on:
``h1#page-title``, ``p#verification-status`` (class ``verified`` or ``failed``),
``table#lineage-matrix`` (``tr.layer[data-layer]``, ``td.count[data-corpus][data-examples]``,
``tr.credential[data-field]``), ``table#policy-rules``, ``table#memorization-report``,
``ul#models`` and ``ul#checkpoints`` on the index. An unknown model or checkpoint is a 404 page.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse

from govray.core.identifiers import ModelName, RecordId, Version
from govray.governance.policy import UNSIGNED_POLICY
from govray.queries import NotFoundError, StoreReader
from serve.lineage_view import (
    CREDENTIAL_FIELDS,
    LineageSheet,
    checkpoint_sheet,
    index_entries,
    version_sheet,
)

router = APIRouter(tags=["lineage page"])
INDEX_LIMIT = 200
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No such model version or checkpoint (an HTML page says which)."}
}

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d232a; }
h1 { font-size: 22px; margin: 0 0 12px; } h2 { font-size: 17px; margin: 26px 0 8px; }
table { border-collapse: collapse; } th, td { border: 1px solid #c9d1d9; padding: 4px 9px; }
th { background: #f3f5f7; text-align: left; font-weight: 600; }
td.count { text-align: right; font-variant-numeric: tabular-nums; }
td.count.zero { color: #9aa4ae; } td.count.reached { background: #e4f0fb; }
tr.credential td { font-size: 12px; color: #414b55; }
thead tr:last-child > * { border-bottom: 2px solid #8c959f; }
th.excluded { text-decoration: line-through; }
#verification-status { font-weight: 700; padding: 8px 12px; display: inline-block; border-radius: 4px; }
.verified { background: #ddf4e4; color: #135a2a; } .failed { background: #fbe0df; color: #8a1712; }
tr.flagged td { background: #fff0d6; } code { font-size: 12px; word-break: break-all; }
dl.facts { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; margin: 0; }
dl.facts dt { font-weight: 600; } p.note { color: #57606a; font-size: 12px; }
"""


def _reader(request: Request) -> StoreReader:
    reader: StoreReader = request.app.state.reader
    return reader


def _trust(request: Request) -> Path | None:
    trust: Path | None = getattr(request.app.state, "trust", None)
    return trust


@router.get("/lineage", response_class=HTMLResponse, summary="Index of lineage pages")
def lineage_index(request: Request) -> HTMLResponse:
    versions, checkpoints = index_entries(_reader(request), INDEX_LIMIT)
    models = "".join(
        f'<li><a href="/lineage/models/{quote(name, safe="")}/{version}">{escape(name)} v{version}</a></li>'
        for name, version in versions
    )
    saved = "".join(
        f'<li><a href="/lineage/checkpoints/{cid}">checkpoint {cid}</a> (trial {trial}, step {step})</li>'
        for cid, trial, step in checkpoints
    )
    body = (
        '<h1 id="page-title">Lineage</h1>'
        f'<h2>Model versions</h2><ul id="models">{models or "<li>none registered</li>"}</ul>'
        f'<h2>Checkpoints</h2><ul id="checkpoints">{saved or "<li>none recorded</li>"}</ul>'
        f'<p class="note">The newest {INDEX_LIMIT} of each. JSON: <a href="/docs">/docs</a>.</p>'
    )
    return HTMLResponse(_document("Lineage", body))


@router.get(
    "/lineage/models/{name}/{version}",
    response_class=HTMLResponse,
    responses=NOT_FOUND,
    summary="Lineage page of a model version",
)
def model_page(
    request: Request, name: Annotated[ModelName, PathParam()], version: Annotated[Version, PathParam()]
) -> HTMLResponse:
    try:
        sheet = version_sheet(_reader(request), name, version, _trust(request))
    except NotFoundError as error:
        return _not_found(str(error))
    return HTMLResponse(render(sheet))


@router.get(
    "/lineage/checkpoints/{checkpoint_id}",
    response_class=HTMLResponse,
    responses=NOT_FOUND,
    summary="Lineage page of a checkpoint",
)
def checkpoint_page(request: Request, checkpoint_id: Annotated[RecordId, PathParam()]) -> HTMLResponse:
    try:
        sheet = checkpoint_sheet(_reader(request), checkpoint_id, _trust(request))
    except NotFoundError as error:
        return _not_found(str(error))
    return HTMLResponse(render(sheet))


def render(sheet: LineageSheet) -> str:
    """The whole page of ``sheet``."""
    status = "verified" if sheet.verification.verified else "failed"
    facts = "".join(f"<dt>{escape(label)}</dt><dd>{escape(value)}</dd>" for label, value in sheet.facts)
    body = (
        f'<h1 id="page-title">{escape(sheet.title)}</h1>'
        '<p><a href="/lineage">all models and checkpoints</a></p>'
        '<section id="verification"><h2>Attestation</h2>'
        f'<p id="verification-status" class="{status}">{escape(sheet.verification.text)}</p></section>'
        f'<section id="facts"><dl class="facts">{facts}</dl></section>'
        f"{_matrix(sheet)}{_policy(sheet)}{_memorization(sheet)}"
    )
    return _document(sheet.title, body)


def _matrix(sheet: LineageSheet) -> str:
    corpora = sheet.corpora
    head = "".join(
        f'<th class="corpus{" excluded" if c.excluded else ""}" data-corpus="{escape(c.corpus_id)}">'
        f"{escape(c.corpus_id)}</th>"
        for c in corpora
    )
    credentials = "".join(
        f'<tr class="credential" data-field="{field}"><th>{field.replace("_", " ")}</th>'
        + "".join(f"<td>{escape(c.credential[field])}</td>" for c in corpora)
        + "</tr>"
        for field in CREDENTIAL_FIELDS
    )
    rows = []
    for layer in sheet.lineage.layers:
        counts = {entry.corpus_id: entry for entry in layer.corpora}
        cells = []
        for corpus in corpora:
            entry = counts.get(corpus.corpus_id)
            examples = entry.examples if entry is not None else 0
            title = f"{entry.steps} steps, {entry.tensors} tensors" if entry is not None else "did not reach"
            kind = "reached" if examples else "zero"
            cells.append(
                f'<td class="count {kind}" data-corpus="{escape(corpus.corpus_id)}" '
                f'data-examples="{examples}" title="{escape(title)}">{examples:,}</td>'
            )
        rows.append(
            f'<tr class="layer" data-layer="{escape(layer.layer)}"><th>{escape(layer.layer)}</th>'
            f"{''.join(cells)}</tr>"
        )
    source = "this checkpoint's ledger" if sheet.lineage.ledger == "checkpoint" else "the trial's ledger"
    return (
        '<section id="matrix"><h2>Layers &times; corpora</h2>'
        f'<p class="note">Examples whose gradients directly updated a tensor of the layer (the most over '
        f"its tensors), from {source} at step {sheet.lineage.step}. A frozen lower layer is still "
        "influenced indirectly through the layers above it.</p>"
        f'<table id="lineage-matrix"><thead><tr><th>layer \\ corpus</th>{head}</tr>{credentials}</thead>'
        f"<tbody>{''.join(rows) or _empty_row(len(corpora) + 1, 'no ledger rows')}</tbody></table></section>"
    )


def _policy(sheet: LineageSheet) -> str:
    policy = sheet.policy
    rules = "".join(
        f'<tr data-rule="{escape(name)}"><td>{escape(name)}</td><td>{escape(match)}</td>'
        f"<td>{escape(route)}</td></tr>"
        for name, match, route in policy.rules
    )
    note = f'<p class="note">{escape(policy.note)}</p>' if policy.note else ""
    return (
        '<section id="policy"><h2>Policy</h2><dl class="facts">'
        f'<dt>name</dt><dd id="policy-name">{escape(policy.name)}</dd>'
        f'<dt>version</dt><dd id="policy-version">{escape(policy.version)}</dd>'
        f'<dt>sha256</dt><dd><code id="policy-digest">{escape(policy.digest)}</code></dd>'
        f"<dt>signed by</dt>{_policy_signer(policy.signer)}</dl>"
        '<table id="policy-rules"><thead><tr><th>rule</th><th>matches</th><th>may update</th></tr></thead>'
        f"<tbody>{rules or _empty_row(3, 'rules unavailable')}</tbody></table>{note}</section>"
    )


def _policy_signer(signer: str) -> str:
    if signer == UNSIGNED_POLICY:
        return (
            '<dd id="policy-signer" class="failed">UNSIGNED: nobody vouched for this policy '
            "(the operator let the run through)</dd>"
        )
    return f'<dd id="policy-signer"><code>{escape(signer)}</code></dd>'


def _memorization(sheet: LineageSheet) -> str:
    report = sheet.memorization
    flagged = [row.corpus_id for row in report.rows if row.flagged]
    if not report.rows:
        summary = "no memorization report in the attestation"
    elif flagged:
        summary = f"flagged: {', '.join(flagged)} (policy action: {report.action})"
    else:
        summary = "no corpus flagged"
    rows = "".join(
        f'<tr class="{"flagged" if row.flagged else "clean"}" data-corpus="{escape(row.corpus_id)}">'
        f"<td>{escape(row.corpus_id)}</td><td>{row.score:.3f}</td><td>{'yes' if row.flagged else 'no'}</td>"
        f"<td>{escape(', '.join(f'{k} {v:.3f}' for k, v in sorted(row.measures.items())))}</td></tr>"
        for row in report.rows
    )
    metrics = ", ".join(f"{name} = {value:g}" for name, value in sorted(report.metrics.items()))
    return (
        '<section id="memorization"><h2>Memorization</h2>'
        f'<p id="memorization-summary">{escape(summary)}</p>'
        '<table id="memorization-report"><thead><tr><th>corpus</th><th>score</th><th>flagged</th>'
        f"<th>measures / threshold</th></tr></thead><tbody>{rows or _empty_row(4, 'none')}</tbody></table>"
        f'<p class="note">Latest trial metrics: {escape(metrics or "none recorded")}.</p></section>'
    )


def _empty_row(span: int, text: str) -> str:
    return f'<tr><td colspan="{span}">{escape(text)}</td></tr>'


def _not_found(message: str) -> HTMLResponse:
    body = (
        f'<h1 id="page-title">Not found</h1><p id="error">{escape(message)}</p>'
        '<p><a href="/lineage">index</a></p>'
    )
    return HTMLResponse(_document("Not found", body), status_code=404)


def _document(title: str, body: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)} · govray</title><style>{STYLE}</style></head><body>{body}</body></html>"
    )
