"""How the lineage app is started: its settings (the settings file and the environment, then a
YAML file, then options),
Serve's own ``serve run serve.app:app`` import path, ``govray serve`` starting the app its
``govray.apps`` entry point names on the given host and port (govray never imports ``serve/``), and
refusing to start without a tracking store. None of it needs Ray; tests/test_serve_app.py serves
for real."""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.cli import main
from govray.cli.serve import APP_GROUP, LINEAGE_APP
from govray.config.serve import ServeSettings
from govray.core.errors import ConfigError


def test_settings_come_from_the_environment_then_the_config_file_then_options(tmp_path: Path) -> None:
    environ = {
        "GOVRAY_HOME": str(tmp_path / "home"),  # no settings file there
        "GOVRAY_DATABASE": "sqlite:///cli-name.db",
        "GOVRAY_SERVE_TOKEN": "from-env",
        "GOVRAY_TRUST": "trust.yaml",
        "GOVRAY_SERVE_PORT": "9000",
    }
    from_env = ServeSettings.load(environ=environ)
    assert (from_env.database_url, from_env.port, from_env.host) == (
        "sqlite:///cli-name.db",
        9000,
        "127.0.0.1",
    )
    assert from_env.token is not None and from_env.token.get_secret_value() == "from-env"
    assert "from-env" not in repr(from_env)  # the token never lands in a log line

    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.yaml").write_text(
        yaml.safe_dump({"store": {"database_url": "sqlite:///settings.db"}, "serve": {"host": "0.0.0.0"}})
    )
    from_settings = ServeSettings.load(environ={"GOVRAY_HOME": str(tmp_path / "home")})
    assert (from_settings.database_url, from_settings.host) == ("sqlite:///settings.db", "0.0.0.0")
    assert ServeSettings.load(environ=environ).database_url == "sqlite:///cli-name.db"  # the variable wins

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"database_url": "sqlite:///file.db", "port": 9001}))
    layered = ServeSettings.load(config, {"port": 9002, "host": None}, environ=environ)
    assert (layered.database_url, layered.port, layered.trust, layered.host) == (
        "sqlite:///file.db",
        9002,
        Path("trust.yaml"),
        "0.0.0.0",
    )


def test_bad_settings_are_refused_naming_the_field(tmp_path: Path) -> None:
    home = {"GOVRAY_HOME": str(tmp_path / "home")}
    with pytest.raises(ConfigError, match="no tracking store given"):
        ServeSettings.load(environ=home)
    with pytest.raises(ConfigError, match="port"):
        ServeSettings.load(
            environ={**home, "GOVRAY_DATABASE": "sqlite:///a.db", "GOVRAY_SERVE_PORT": "eighty"}
        )
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"database_url": "sqlite:///a.db", "tokn": "typo"}))
    with pytest.raises(ConfigError, match=f"{config}: unknown field 'tokn'"):
        ServeSettings.load(config, environ=home)


def test_serve_run_finds_the_app_by_its_import_path(tmp_path: Path) -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr
    from ray.serve.deployment import Application

    builder = import_attr("serve.app:app")  # what `serve run serve.app:app key=value` resolves
    built = call_user_app_builder_with_args_if_necessary(builder, {"database_url": "sqlite:///x.db"})
    assert isinstance(built, Application)
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"database_url": "sqlite:///y.db", "token": "t"}))
    assert isinstance(
        call_user_app_builder_with_args_if_necessary(builder, {"config": str(config)}), Application
    )


def test_govray_serve_refuses_to_start_without_a_store(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("GOVRAY_DATABASE", raising=False)
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path))  # no settings file
    assert main(["serve", "--port", "8123"]) == 2
    assert "no tracking store given" in capsys.readouterr().err


STARTED: list[tuple[ServeSettings, bool]] = []


def record_start(settings: ServeSettings, *, blocking: bool = False) -> str:
    """A stand-in for serve.app:start that records what it was asked to serve."""
    STARTED.append((settings, blocking))
    return f"http://{settings.host}:{settings.port}"


def test_the_lineage_app_entry_point_names_serve_apps_start() -> None:
    from serve.app import start

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"][APP_GROUP][LINEAGE_APP]
    assert EntryPoint(name=LINEAGE_APP, value=value, group=APP_GROUP).load() is start


def test_govray_serve_starts_the_installed_app_on_the_given_host_and_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def installed(group: str) -> list[EntryPoint]:
        value = f"{__name__}:record_start"
        return [EntryPoint(name=LINEAGE_APP, value=value, group=group)] if group == APP_GROUP else []

    monkeypatch.setattr(sys.modules["govray.cli.serve"], "entry_points", installed)
    monkeypatch.setenv("GOVRAY_SERVE_TOKEN", "t0ken")
    STARTED.clear()
    options: list[Any] = ["--database", "sqlite:///served.db", "--host", "0.0.0.0", "--port", "8124"]
    assert main(["serve", *options]) == 0
    [(settings, blocking)] = STARTED
    assert (settings.database_url, settings.host, settings.port, blocking) == (
        "sqlite:///served.db",
        "0.0.0.0",
        8124,
        True,
    )
    assert settings.token is not None and settings.token.get_secret_value() == "t0ken"
    assert "lineage app on http://0.0.0.0:8124/api" in capsys.readouterr().out


def test_govray_serve_without_the_entry_point_says_how_to_register_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.modules["govray.cli.serve"], "entry_points", lambda group: [])
    assert main(["serve", "--database", "sqlite:///served.db"]) == 2
    assert (
        "no lineage app is installed (entry point 'lineage' in group govray.apps)" in capsys.readouterr().err
    )
