"""One settings file, ``GOVRAY_HOME/config.yaml``: every setting comes from the file, then from its
one documented environment variable, then from a command-line option; a bad file or value is
refused naming where it came from; govray reads ``GOVRAY_*`` variables and sets none for itself."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import yaml

from govray.cli import main
from govray.core.errors import ConfigError
from govray.core.keys import platform_key_path
from govray.core.settings import OVERRIDES, SETTINGS_FILE, load_settings, settings_path
from govray.tracking.store import TrackingStore
from tests.helpers.builders import REPO

# Variables govray reads that are not settings: where the settings file is, and what `govray
# submit` gives the job it submits in its runtime_env (the job's input, read by `govray job
# verify-pins` in that job's process on the cluster).
NOT_SETTINGS = {"GOVRAY_HOME", "GOVRAY_PINNED_PACKAGES"}
PRODUCT = ("govray", "serve", "searchers", "jobs")


def written(home: Path, settings: dict[str, object]) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / SETTINGS_FILE).write_text(yaml.safe_dump(settings))
    return {"GOVRAY_HOME": str(home)}


def test_every_setting_comes_from_the_file_then_its_variable(tmp_path: Path) -> None:
    environ = written(
        tmp_path / "home",
        {
            "store": {"database_url": "sqlite:///file.db"},
            "trust": "trust.yaml",
            "serve": {"token": "from-file", "port": 9001},
            "trial_hosts": {"enabled": False, "idle_s": 30},
            "cache": str(tmp_path / "cache"),
        },
    )
    settings = load_settings(environ)
    assert settings_path(environ) == tmp_path / "home" / "config.yaml"
    assert settings.store.database_url == "sqlite:///file.db"
    assert (settings.trust, settings.serve.port, settings.serve.host) == (
        Path("trust.yaml"),
        9001,
        "127.0.0.1",
    )
    assert settings.serve.token is not None and settings.serve.token.get_secret_value() == "from-file"
    assert "from-file" not in repr(settings)  # the token never lands in a log line
    assert (settings.trial_hosts.enabled, settings.trial_hosts.idle_s) == (False, 30.0)
    assert settings.cache_root == tmp_path / "cache"

    overridden = load_settings(
        {
            **environ,
            "GOVRAY_DATABASE": "sqlite:///env.db",
            "GOVRAY_SERVE_PORT": "9002",
            "GOVRAY_TRIAL_HOSTS": "1",
            "GOVRAY_TRIAL_HOST_IDLE_S": "5",
            "GOVRAY_CACHE": "/elsewhere",
            "GOVRAY_SERVE_HOST": "",  # empty: not set
        }
    )
    assert overridden.store.database_url == "sqlite:///env.db"
    assert (overridden.serve.port, overridden.serve.host, overridden.trust) == (
        9002,
        "127.0.0.1",
        Path("trust.yaml"),
    )
    assert (overridden.trial_hosts.enabled, overridden.trial_hosts.idle_s) == (True, 5.0)
    assert overridden.cache_root == Path("/elsewhere")


def test_without_a_file_every_default_holds(tmp_path: Path) -> None:
    settings = load_settings({"GOVRAY_HOME": str(tmp_path / "none")})
    assert settings.store.database_url is None and settings.serve.token is None
    assert (settings.trial_hosts.enabled, settings.trial_hosts.idle_s) == (True, 300.0)
    assert settings.cache_root == Path("~/.cache/govray").expanduser()


def test_a_bad_file_or_value_is_refused_naming_where_it_came_from(tmp_path: Path) -> None:
    environ = written(tmp_path / "typo", {"serve": {"tokn": "x"}})
    with pytest.raises(ConfigError, match=rf"settings from {tmp_path / 'typo' / 'config.yaml'}: .*tokn"):
        load_settings(environ)
    environ = written(tmp_path / "section", {"signer": {"kind": "hsm"}})  # a section no issue added yet
    with pytest.raises(ConfigError, match="signer"):
        load_settings(environ)
    environ = written(tmp_path / "ok", {"serve": {"port": 8000}})
    with pytest.raises(ConfigError, match=r"with GOVRAY_SERVE_PORT: .*port"):
        load_settings({**environ, "GOVRAY_SERVE_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"with GOVRAY_TRIAL_HOSTS: .*enabled"):
        load_settings({**environ, "GOVRAY_TRIAL_HOSTS": "maybe"})
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / SETTINGS_FILE).write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="a settings file is a mapping"):
        load_settings({"GOVRAY_HOME": str(tmp_path / "list")})


def test_a_command_opens_the_store_the_settings_file_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'settings.db'}"
    store = TrackingStore.open(url)
    store.create_experiment("named-by-the-settings", "{}", "digest", str(tmp_path / "storage"))
    store.close()
    monkeypatch.delenv("GOVRAY_DATABASE", raising=False)
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path / "home"))
    assert main(["experiment", "list"]) == 2  # no store anywhere: refused, saying where to name one
    refused = capsys.readouterr().err
    assert "no tracking store given" in refused and str(tmp_path / "home" / "config.yaml") in refused
    written(tmp_path / "home", {"store": {"database_url": url}})
    assert main(["experiment", "list"]) == 0
    assert "named-by-the-settings" in capsys.readouterr().out
    other = f"sqlite:///{tmp_path / 'other.db'}"
    monkeypatch.setenv("GOVRAY_DATABASE", other)  # the variable wins over the file
    assert main(["experiment", "list"]) == 0
    assert "named-by-the-settings" not in capsys.readouterr().out
    assert main(["experiment", "list", "--database", url]) == 0  # and the option over both
    assert "named-by-the-settings" in capsys.readouterr().out


def product_sources() -> list[Path]:
    return [path for top in PRODUCT for path in sorted((REPO / top).rglob("*.py"))]


def test_every_variable_govray_reads_is_a_documented_override_of_a_setting() -> None:
    named = {
        name
        for path in product_sources()
        for name in re.findall(r"\bGOVRAY_[A-Z_]+\b", path.read_text())
        if name != "GOVRAY_VERSION"  # a constant (govray.core.version), not a variable
    }
    assert named - NOT_SETTINGS == set(OVERRIDES), "each GOVRAY_* variable overrides one setting"
    readme = (REPO / "README.md").read_text()
    settings = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    undocumented = [
        name for name in sorted(OVERRIDES) + sorted(NOT_SETTINGS) if not re.search(rf"\b{name}\b", settings)
    ]
    assert undocumented == []


def reads_an_override(path: Path) -> list[str]:
    """Where ``path`` reads one of ``OVERRIDES``'s variables itself (``os.environ[...]``,
    ``.get(...)``, ``os.getenv(...)``) instead of asking the settings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and node.args
            and re.search(r"(environ\.get|getenv)$", ast.unparse(node.func))
        ):
            key = node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in OVERRIDES:
            found.append(f"{path.name}:{node.lineno}")
    return sorted(found, key=lambda where: int(where.rsplit(":", 1)[1]))


def test_only_the_settings_read_the_variables_that_override_them(tmp_path: Path) -> None:
    """The CLI's ``--database`` option reads ``GOVRAY_DATABASE`` through typer (``envvar``), the
    same override; every other read goes through ``govray.core.settings``."""
    settings_module = REPO / "govray" / "core" / "settings.py"
    assert [
        where for path in product_sources() if path != settings_module for where in reads_an_override(path)
    ] == []
    module = tmp_path / "module.py"
    module.write_text(
        "import os\nos.environ.get('GOVRAY_TRIAL_HOSTS', '1')\nos.environ['GOVRAY_CACHE']\n"
        "os.getenv('GOVRAY_DATABASE')\nos.environ.get('HOME')\n"
    )
    assert reads_an_override(module) == ["module.py:2", "module.py:3", "module.py:4"]


def sets_a_govray_variable(path: Path) -> list[str]:
    """Where ``path`` writes a ``GOVRAY_*`` environment variable into this process: an assignment
    to ``os.environ[...]``, ``os.environ.setdefault``/``update``, ``os.putenv``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = ast.unparse(node) if isinstance(node, ast.Assign | ast.Call | ast.AugAssign) else ""
        if "GOVRAY_" not in text:
            continue
        if isinstance(node, ast.Assign) and any("environ[" in ast.unparse(target) for target in node.targets):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.AugAssign) and "environ" in ast.unparse(node.target):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and re.match(r"os\.(environ\.(setdefault|update)|putenv)\(", text):
            found.append(f"{path.name}:{node.lineno}")
    return sorted(found, key=lambda where: int(where.rsplit(":", 1)[1]))


def test_govray_never_sets_a_govray_variable_for_itself(tmp_path: Path) -> None:
    assert [where for path in product_sources() for where in sets_a_govray_variable(path)] == []
    module = tmp_path / "module.py"
    module.write_text(
        "import os\nos.environ['GOVRAY_TRIAL_HOSTS'] = '0'\nos.environ.setdefault('GOVRAY_CACHE', '/c')\n"
        "os.environ['RAY_AIR_NEW_OUTPUT'] = '0'\nos.environ |= {'GOVRAY_HOME': '/h'}\n"
    )
    assert sets_a_govray_variable(module) == ["module.py:2", "module.py:3", "module.py:5"]


def test_the_tests_never_read_or_write_the_developers_govray_home() -> None:
    """The session runs in a home of its own (``tests/conftest.py``), with no setting overridden by
    the developer's environment: their settings, keys and Ray head are not the tests'."""
    home = Path(os.environ["GOVRAY_HOME"])
    assert home.name.startswith("govray-tests-home-") and home != Path("~/.govray").expanduser()
    assert platform_key_path().is_relative_to(home)
    assert [name for name in OVERRIDES if name in os.environ] == []
