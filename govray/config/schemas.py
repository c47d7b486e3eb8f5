"""The JSON Schemas of the files a user writes, exported from the models that read them, and the
reference rendered from those schemas (``docs/reference.md``).

Each document govray reads from a user's YAML is a pydantic model: the experiment file
(``ExperimentConfig``, searchers and hyperparameter spaces included), the depth policy
(``DepthPolicy``), the trust file (``TrustConfig``), the settings file (``Settings``,
``GOVRAY_HOME/config.yaml``) and the lineage server's config (``ServeSettings``). Their schemas are
what those models validate, so an editor that reads them (``# yaml-language-server:
$schema=...`` on a file's first line) flags what govray would refuse. ``govray schema NAME`` prints
one; ``python -m govray.config.schemas --write`` writes every schema under ``docs/schemas/`` and
the reference beside them, and ``tests/test_reference.py`` fails when the files in the repository
drift from the models.

Example::

    schema("policy")["properties"]["rules"]   # {"items": {"$ref": "#/$defs/Rule"}, ...}
    reference()                               # docs/reference.md, as markdown
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import installed_searchers, searcher_model
from govray.config.serve import ServeSettings
from govray.core.keys import TrustConfig
from govray.core.settings import Settings
from govray.governance.credentials import ROW_OVERRIDABLE_FIELDS, Credential
from govray.governance.policy import DepthPolicy

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_DIR = Path("docs/schemas")  # in the repository: NAME.schema.json
REFERENCE = Path("docs/reference.md")


@dataclass(frozen=True)
class Document:
    """A file a user writes: the model that reads it, what it is, and a short example."""

    model: type[BaseModel]
    what: str
    example: str


DOCUMENTS: dict[str, Document] = {
    "experiment": Document(
        ExperimentConfig,
        "The experiment file (`govray run|search|submit EXPERIMENT.yaml`): the trial, its data and "
        "credentials, the policy, training, resources, the searcher, tracking and storage. Relative "
        "paths resolve against the file's directory. A whole one: `jobs/examples/digits/experiment.yaml`.",
        "name: tumor-governed\n"
        "trial: tumor.trial:TumorTrial\n"
        "hyperparameters: {hidden: 32, lr: {type: log, minval: -3, maxval: -1, base: 10}}\n"
        "data:\n"
        "  corpora:\n"
        "    - id: tumor-public\n"
        "      path: data/public.csv\n"
        "      credential:\n"
        "        license_class: public-domain\n"
        "        jurisdiction: US\n"
        "        sensitivity: public\n"
        "        source_type: public-dataset\n"
        "        modality: tabular\n"
        "        collection_period: {start: 1995-01-01, end: 1995-12-31}\n"
        "policy: {file: policies/tumor.policy.yaml, trust: policies/trust.yaml}\n"
        "resources: {workers: 2}\n"
        "searcher: {name: random, metric: validation_loss, max_trials: 4, max_length: {epochs: 2}}\n",
    ),
    "policy": Document(
        DepthPolicy,
        "The depth policy (signed by `govray policy sign`): which layers each credential may update, "
        "or only a removable adapter. A whole one: `policies/digits.policy.yaml`.",
        "name: tumor\n"
        "version: 1\n"
        "adapters:\n"
        "  pii-lora: {kind: lora, targets: [hidden], rank: 4, alpha: 8}\n"
        "rules:\n"
        "  - name: public\n"
        "    match: {license_class: [public-domain, permissive]}\n"
        "    route: all\n"
        "  - name: licensed\n"
        "    match: {license_class: licensed}\n"
        "    route: {depth: {min: -2}}\n"
        "  - name: pii\n"
        "    match: {sensitivity: [pii]}\n"
        "    route: {adapter: pii-lora}\n",
    ),
    "trust": Document(
        TrustConfig,
        "The trust file (`--trust`, the settings' `trust`): the public keys trusted per role, their "
        "revocations, and the time-stamping authorities whose stamps count. `govray keys` edits it; "
        "an example: `policies/trust.yaml`.",
        "keys:\n"
        "  - role: policy-authority\n"
        "    keytype: ed25519\n"
        "    scheme: ed25519\n"
        "    public: 68fca628781b6ccfdac0c6243e77a1c223bc1ae250d734f5b17066dcc41034e4\n"
        "    keyid: 38ecce21b7ba4dea9663d040749330a6f8c7b2954ada6e0294ccc117d1b9bddb\n"
        "revoked: []\n",
    ),
    "settings": Document(
        Settings,
        "The operator's settings (`GOVRAY_HOME/config.yaml`; each key also an environment variable: "
        'README "Settings").',
        'store: {database_url: "sqlite:////srv/govray/tracking.db"}\n'
        "trust: /etc/govray/trust.yaml\n"
        "signer: {socket: /run/govray-signer/signer.sock}\n",
    ),
    "serve": Document(
        ServeSettings,
        "The lineage server's config (`govray serve --config FILE`), over the settings' `serve` section.",
        "database_url: sqlite:///runs/tracking.db\ntrust: policies/trust.yaml\nport: 8000\n",
    ),
}


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of document ``name`` (``KeyError``: no such document)."""
    document = DOCUMENTS[name]
    exported = document.model.model_json_schema(by_alias=True, mode="validation")
    if document.model is ExperimentConfig:
        _experiment_parts(exported)
    return {"$schema": JSON_SCHEMA_DIALECT, "title": f"govray {name} file", **exported}


def _experiment_parts(exported: dict[str, Any]) -> None:
    """What the experiment model validates in code, spelled out: a corpus's ``credential`` (the
    credential model's fields but ``corpus_id``, which ``id`` gives; the fields a corpus may give
    per row through ``credential_columns`` are not required here) and ``searcher`` (one of the
    installed strategies' models, chosen by ``name``)."""
    defs = exported.setdefault("$defs", {})
    credential = _merged(defs, Credential.model_json_schema(by_alias=True))
    credential["properties"].pop("corpus_id", None)
    credential["required"] = [
        field
        for field in credential.get("required", [])
        if field not in {"corpus_id", *ROW_OVERRIDABLE_FIELDS}
    ]
    defs["CorpusCredential"] = credential
    corpus = defs["CorpusSpec"]["properties"]
    corpus["credential"] = {
        "$ref": "#/$defs/CorpusCredential",
        "description": "The corpus's credential (fields credential_columns names come from each row).",
    }
    choices = []
    for strategy in sorted(installed_searchers()):
        model = searcher_model(strategy)
        own = _merged(defs, model.model_json_schema(by_alias=True))
        own["properties"]["name"] = {"const": strategy, "description": "The search strategy."}
        own["required"] = sorted({*own.get("required", []), "name"})
        defs[model.__name__] = own
        choices.append({"$ref": f"#/$defs/{model.__name__}"})
    searcher = exported["properties"]["searcher"]
    exported["properties"]["searcher"] = {
        "oneOf": choices,
        "description": searcher.get("description", "The search strategy and its settings."),
        **({"default": searcher["default"]} if "default" in searcher else {}),
    }
    space = exported["properties"]["hyperparameters"]
    space["additionalProperties"] = {
        "anyOf": [
            space["additionalProperties"],
            {"not": {"type": "object", "required": ["type"]}, "description": "A bare value: its constant."},
        ]
    }
    reached = set(_reached(exported, defs))
    for unused in [name for name in defs if name not in reached]:  # (the strategies' common base)
        del defs[unused]


def _merged(defs: dict[str, Any], exported: dict[str, Any]) -> dict[str, Any]:
    """``exported`` without its ``$defs``, which join ``defs`` (one definition per name)."""
    for name, definition in exported.pop("$defs", {}).items():
        if defs.setdefault(name, definition) != definition:
            raise ValueError(f"two schema definitions named {name} differ")
    return exported


def schema_text(name: str) -> str:
    return json.dumps(schema(name), indent=2, sort_keys=True) + "\n"


def reference() -> str:
    """``docs/reference.md``: every document's keys, types, defaults and allowed values."""
    lines = [
        "# Reference: the files you write",
        "",
        "Generated from the models that read them (`python -m govray.config.schemas --write`; "
        "`tests/test_reference.py` fails when it drifts). Each file's JSON Schema is in "
        "`docs/schemas/`: put `# yaml-language-server: $schema=PATH/TO/docs/schemas/NAME.schema.json` "
        "on a file's first line and an editor flags what govray would refuse. `govray schema NAME` "
        "prints one.",
        "",
    ]
    for name in DOCUMENTS:
        lines += [f"- [{name}](#{name}): `docs/schemas/{name}.schema.json`"]
    for name, document in DOCUMENTS.items():
        lines += _document_section(name, document, schema(name))
    return "\n".join(lines).rstrip() + "\n"


def _document_section(name: str, document: Document, exported: dict[str, Any]) -> list[str]:
    defs = exported.get("$defs", {})
    lines = ["", f'<a id="{name}"></a>', "", f"## {name}", "", document.what, "", "```yaml"]
    lines += [document.example.rstrip(), "```", ""]
    lines += _object_table(name, exported)
    for def_name in _reached(exported, defs):
        lines += ["", f'<a id="{name}-{def_name.lower()}"></a>', "", f"### {name}: `{def_name}`", ""]
        lines += _object_table(name, defs[def_name])
    return lines


def _reached(root: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    """The definitions ``root`` refers to, in the order a reader meets them (breadth first)."""
    order: list[str] = []
    queue = [root]
    while queue:
        for ref in _refs(queue.pop(0)):
            if ref not in order and ref in defs:
                order.append(ref)
                queue.append(defs[ref])
    return order


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"].rsplit("/", 1)[-1]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for key, value in node.items() if key != "$defs" for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def _object_table(document: str, node: dict[str, Any]) -> list[str]:
    description = node.get("description")
    lines = [_cell(description), ""] if description else []
    if "enum" in node:
        return [*lines, f"One of: {_enum(node['enum'])}."]
    properties = node.get("properties")
    if not properties:
        return [*lines, f"Type: {_type(document, node)}."]
    required = set(node.get("required", ()))
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for key, prop in properties.items():
        default = "required" if key in required else _default(prop)
        lines.append(
            f"| `{key}` | {_type(document, prop)} | {default} | {_cell(prop.get('description', ''))} |"
        )
    if node.get("additionalProperties") is False:
        lines += ["", "No other key is accepted."]
    return lines


def _default(prop: dict[str, Any]) -> str:
    if "default" not in prop:
        return "—"
    return f"`{_cell(json.dumps(prop['default']))}`"


def _enum(values: list[Any]) -> str:
    return ", ".join(f"`{_cell(json.dumps(value))}`" for value in values)


def _type(document: str, prop: dict[str, Any]) -> str:
    """A property's type in words, with links to the definitions it refers to."""
    if isinstance(prop.get("$ref"), str):
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{document}-{name.lower()})"
    if "enum" in prop:
        return f"one of {_enum(prop['enum'])}"
    if "const" in prop:
        return f"`{_cell(json.dumps(prop['const']))}`"
    for union in ("anyOf", "oneOf", "allOf"):
        if union in prop:
            return " or ".join(_type(document, choice) for choice in prop[union])
    kind = prop.get("type")
    if kind == "array":
        items = prop.get("items")
        return f"list of {_type(document, items)}" if isinstance(items, dict) else "list"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"mapping to {_type(document, values)}" if isinstance(values, dict) else "mapping"
    if not kind and prop.get("description"):
        return f"any ({_cell(prop['description']).rstrip('.')})"
    words = str(kind) if kind else "any"
    bounds = [
        f"{sign} {prop[key]}"
        for key, sign in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("exclusiveMaximum", "<"),
        )
        if key in prop
    ]
    if "pattern" in prop:
        bounds.append(f"matching `{_cell(prop['pattern'])}`")
    if "format" in prop:
        words += f" ({prop['format']})"
    return " ".join([words, *bounds])


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def write(root: Path) -> list[Path]:
    """Write every schema and the reference under ``root`` (the repository); the paths written."""
    written = []
    for name in DOCUMENTS:
        path = root / SCHEMA_DIR / f"{name}.schema.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(schema_text(name))
        written.append(path)
    (root / REFERENCE).write_text(reference())
    return [*written, root / REFERENCE]


def drifted(root: Path) -> list[Path]:
    """The generated files under ``root`` that differ from what the models give now."""
    wanted = {root / SCHEMA_DIR / f"{name}.schema.json": schema_text(name) for name in DOCUMENTS}
    wanted[root / REFERENCE] = reference()
    return [path for path, text in wanted.items() if not path.is_file() or path.read_text() != text]


if __name__ == "__main__":  # python -m govray.config.schemas --write [ROOT]
    if sys.argv[1:2] != ["--write"]:
        sys.exit("usage: python -m govray.config.schemas --write [REPOSITORY_ROOT]")
    for path in write(Path(sys.argv[2]) if len(sys.argv) > 2 else Path.cwd()):
        print(path)
