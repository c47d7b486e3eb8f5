"""The lineage page in a real browser: a governed run, registered, served by the Ray Serve app on
127.0.0.1 and loaded in headless Chromium (Debian's, installed by ``install_chromium.sh`` when
missing). Cluster tier: ``python -m pytest -m cluster tests/cluster/test_lineage_page.py``.

Screenshots are kept as artifacts in ``$GOVRAY_ARTIFACTS`` (default: ``test-artifacts/`` in the
repository root, which git ignores).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests

from govray.core.canonical import file_sha256
from govray.core.keys import TrustConfig, platform_key, save_trust
from govray.platform.registry.register import register, remove_adapter
from govray.platform.registry.versions import RegisteredVersion
from govray.tracking.lineage import checkpoints, ledger_rows
from govray.tracking.store import TrackingStore
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.builders import REPO
from tests.helpers.golden import golden_run_at
from tests.helpers.ports import free_port

pytestmark = pytest.mark.cluster

DIGITS_LAYERS = ["embed", "hidden", "head"]  # the digits trial's ordered layers (policies/digits.policy.yaml)
WINDOW = (1280, 1600)


@dataclass
class GovernedModel:
    store: TrackingStore
    trial_id: int
    checkpoint_id: int
    version: RegisteredVersion  # digits:1, the trial's last checkpoint
    without_adapter: RegisteredVersion  # digits:2, a copy without the PII adapter
    trust: Path


@dataclass
class Page:
    """What a test reads off the rendered DOM."""

    title: str = ""
    status: str = ""
    status_class: str = ""
    matrix: dict[str, dict[str, int]] = field(default_factory=dict)  # layer → corpus → examples
    credentials: dict[str, list[str]] = field(default_factory=dict)  # field → values, column order
    corpora: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    policy: dict[str, str] = field(default_factory=dict)
    memorization: str = ""
    memorized: dict[str, bool] = field(default_factory=dict)  # corpus → flagged


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self._text: list[str] | None = None
        self._target = ""
        self._layer: str | None = None
        self._credential: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {name: value or "" for name, value in attrs}
        if a.get("id") in ("page-title", "verification-status", "memorization-summary") or (
            a.get("id", "").startswith("policy-") and a.get("id") != "policy-rules"
        ):
            self._target, self._text = a["id"], []
            if a["id"] == "verification-status":
                self.page.status_class = a.get("class", "")
        elif tag == "tr" and "layer" in a.get("class", "").split():
            self._layer = a["data-layer"]
            self.page.matrix[self._layer] = {}
        elif tag == "tr" and "credential" in a.get("class", "").split():
            self._credential = a["data-field"]
            self.page.credentials[self._credential] = []
        elif tag == "th" and "corpus" in a.get("class", "").split():
            self.page.corpora.append(a["data-corpus"])
        elif tag == "td" and self._layer is not None and "count" in a.get("class", "").split():
            self.page.matrix[self._layer][a["data-corpus"]] = int(a["data-examples"])
        elif tag == "td" and self._credential is not None:
            self._target, self._text = "credential", []
        elif tag == "tr" and "data-rule" in a:
            self.page.rules.append(a["data-rule"])
        elif tag == "tr" and "data-corpus" in a:
            self.page.memorized[a["data-corpus"]] = "flagged" in a.get("class", "").split()

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._layer = self._credential = None
        if self._text is not None and tag in ("h1", "p", "dd", "code", "td"):
            text = "".join(self._text).strip()
            if self._target == "page-title":
                self.page.title = text
            elif self._target == "verification-status":
                self.page.status = text
            elif self._target == "memorization-summary":
                self.page.memorization = text
            elif self._target == "credential" and self._credential is not None:
                self.page.credentials[self._credential].append(text)
            elif self._target.startswith("policy-"):
                self.page.policy[self._target.removeprefix("policy-")] = text
            self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium, installed by the project's own script when it is missing."""
    if shutil.which("chromium") is None:
        done = subprocess.run(
            ["bash", str(Path(__file__).with_name("install_chromium.sh"))],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"installing chromium failed:\n{done.stdout}\n{done.stderr}"
    found = shutil.which("chromium")
    assert found is not None
    return found


@pytest.fixture(scope="module")
def own_ray() -> Iterator[None]:
    """A Ray instance of this module's own (its own temp dir; never another session's, and no
    ``ray stop``), shut down at the end."""
    import ray

    temp = tempfile.mkdtemp(prefix="govray-page-ray-")  # short: Ray's socket paths have a limit
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def governed_model(own_ray: None, tmp_path_factory: pytest.TempPathFactory) -> GovernedModel:
    """One governed digits run (one worker, 20 steps), registered as digits:1; digits:2 is that
    version without the PII adapter (a sealed copy of its files)."""
    root = tmp_path_factory.mktemp("lineage-page")
    run = golden_run_at(golden_example_at(root, workers=1, max_length={"batches": 20}, lr_schedule=False))
    store = run.store
    final = checkpoints(store, run.outcome.trial_id)[-1]
    assert final.id is not None
    version = register(store, "digits", Path(final.path))
    trust = root / "server-trust.yaml"
    save_trust(TrustConfig(keys=[platform_key().public_key]), trust)
    copy = remove_adapter(store, version.ref, "pii-lora")
    return GovernedModel(store, run.outcome.trial_id, final.id, version, copy, trust)


@pytest.fixture(scope="module")
def app_url(governed_model: GovernedModel) -> Iterator[str]:
    """The lineage app under Ray Serve, listening on 127.0.0.1."""
    from ray import serve

    from govray.config.serve import ServeSettings
    from serve.app import start

    settings = ServeSettings(
        database_url=governed_model.store.url, trust=governed_model.trust, port=free_port()
    )
    url = start(settings)
    deadline = time.monotonic() + 60
    while not _answers(f"{url}/api/ping"):
        assert time.monotonic() < deadline, "the lineage app did not answer /api/ping"
        time.sleep(0.5)
    try:
        yield url
    finally:
        serve.shutdown()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=10).status_code == 200
    except requests.ConnectionError:
        return False


def artifacts() -> Path:
    directory = Path(os.environ.get("GOVRAY_ARTIFACTS", REPO / "test-artifacts"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def browse(chromium: str, url: str, screenshot: str | None = None) -> Page:
    """Load ``url`` in headless Chromium; parse its DOM; save a screenshot when asked."""
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
    with tempfile.TemporaryDirectory(prefix="govray-chromium-") as profile:
        flags.append(f"--user-data-dir={profile}")
        dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr[-2000:]
        if screenshot is not None:
            path = artifacts() / screenshot
            path.unlink(missing_ok=True)
            shot = subprocess.run(
                [*flags, f"--screenshot={path}", f"--window-size={WINDOW[0]},{WINDOW[1]}", url],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert shot.returncode == 0 and path.is_file(), shot.stderr[-2000:]
            assert_meaningful_png(path)
    parser = _PageParser()
    parser.feed(dom.stdout)
    return parser.page


def assert_meaningful_png(path: Path) -> None:
    """A PNG of the window's size whose pixels are not one flat colour."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == WINDOW
    chunks, position = [], 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        if data[position + 4 : position + 8] == b"IDAT":
            chunks.append(data[position + 8 : position + 8 + length])
        position += 12 + length
    pixels = zlib.decompress(b"".join(chunks))
    assert len(set(pixels)) > 16, f"{path} is (nearly) blank"
    assert len(data) > 20_000, f"{path} is suspiciously small ({len(data)} bytes)"


def expected_matrix(model: GovernedModel, without_adapters: bool = False) -> dict[str, dict[str, int]]:
    """layer → corpus → examples, straight from the ledger rows (the most over a layer's tensors)."""
    matrix: dict[str, dict[str, int]] = {}
    for row in ledger_rows(model.store, model.trial_id):
        if row.parameter.startswith("adapter/"):
            if without_adapters:
                continue
            layer = f"adapter:{row.parameter.split('/')[1]}"
        else:
            assert row.layer_index is not None
            layer = DIGITS_LAYERS[row.layer_index]
        cell = matrix.setdefault(layer, {})
        cell[row.corpus_id] = max(cell.get(row.corpus_id, 0), row.examples)
    return matrix


def nonzero(matrix: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {layer: {c: n for c, n in row.items() if n} for layer, row in matrix.items()}


def test_lineage_page_shows_matrix_credentials_policy_and_verified_attestation(
    chromium: str, app_url: str, governed_model: GovernedModel
) -> None:
    page = browse(chromium, f"{app_url}/lineage/models/digits/1", screenshot="lineage-page-digits-v1.png")
    assert page.title == "Lineage of model digits v1"
    assert page.status_class == "verified"
    signer = platform_key().keyid
    assert page.status == f"verified, signed by {signer}"
    # the matrix: the three digits layers and the PII adapter, every corpus a column
    assert list(page.matrix) == [*DIGITS_LAYERS, "adapter:pii-lora"]
    assert page.corpora == ["digits-licensed", "digits-public", "digits-writers"]
    assert nonzero(page.matrix) == expected_matrix(governed_model)
    assert page.matrix["embed"]["digits-licensed"] == 0  # licensed data may update the top two only
    assert page.matrix["hidden"]["digits-writers"] == 0  # PII reaches the adapter alone
    # each corpus's credential, in column order
    assert page.credentials["license_class"] == ["licensed", "public-domain", "proprietary"]
    assert page.credentials["source_type"] == ["licensed-private", "public-dataset", "user-data"]
    assert set(page.credentials) == {"license_class", "jurisdiction", "sensitivity", "source_type"}
    # the policy it trained under, with its rules
    assert page.policy["name"] == "digits" and page.policy["version"] == "1"
    assert page.policy["digest"] == file_sha256(REPO / "policies" / "digits.policy.yaml")
    assert page.rules == ["public", "licensed", "pii"]
    # the attested memorization report: every monitored corpus measured, none flagged this early
    assert page.memorization == "no corpus flagged"
    assert page.memorized == dict.fromkeys(page.corpora, False)


def test_checkpoint_page_and_index_link_to_the_same_lineage(
    chromium: str, app_url: str, governed_model: GovernedModel
) -> None:
    page = browse(chromium, f"{app_url}/lineage/checkpoints/{governed_model.checkpoint_id}")
    assert page.title == f"Lineage of checkpoint {governed_model.checkpoint_id}"
    assert page.status.startswith("verified, signed by ")
    assert nonzero(page.matrix) == expected_matrix(governed_model)
    index = requests.get(f"{app_url}/lineage", timeout=30)
    assert index.status_code == 200
    assert 'href="/lineage/models/digits/1"' in index.text and 'href="/lineage/models/digits/2"' in index.text
    assert f'href="/lineage/checkpoints/{governed_model.checkpoint_id}"' in index.text


def test_version_without_the_adapter_verifies_then_a_flipped_byte_fails(
    chromium: str, app_url: str, governed_model: GovernedModel
) -> None:
    page = browse(chromium, f"{app_url}/lineage/models/digits/2")
    assert page.status_class == "verified"
    assert "adapter:pii-lora" not in page.matrix
    assert nonzero(page.matrix) == expected_matrix(governed_model, without_adapters=True)
    weights = governed_model.without_adapter.directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    # The version's base is a hard link to version 1's (registry.remove_adapter: no second copy of
    # the base), so an edit in place would change both; a tampered file put in its place changes
    # only this version.
    tampered = weights.with_name("tampered.tmp")
    tampered.write_bytes(bytes(data))
    tampered.replace(weights)
    page = browse(chromium, f"{app_url}/lineage/models/digits/2", screenshot="lineage-page-tampered.png")
    assert page.status_class == "failed"
    assert page.status.startswith("FAILED: ")
    assert f"{weights}: sha256 differs from the attested digest (tampered)" in page.status
    assert nonzero(page.matrix) == expected_matrix(governed_model, without_adapters=True)  # still shown
    again = browse(chromium, f"{app_url}/lineage/models/digits/1")
    assert again.status_class == "verified"  # the original files are untouched


def test_unknown_model_or_checkpoint_is_a_404_page(app_url: str) -> None:
    for path, reason in [
        ("/lineage/models/nope/1", "no registered model 'nope'"),
        ("/lineage/models/digits/99", "has no version 99"),
        ("/lineage/checkpoints/999999", "no checkpoint with id 999999"),
    ]:
        answer = requests.get(app_url + path, timeout=30)
        assert answer.status_code == 404, path
        assert answer.headers["content-type"].startswith("text/html")
        assert reason in answer.text.replace("&#x27;", "'"), answer.text
    for path in ("/lineage/checkpoints/0", "/lineage/checkpoints/abc", "/lineage/models/digits/-1"):
        assert requests.get(app_url + path, timeout=30).status_code == 422, path
