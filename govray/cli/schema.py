"""``govray schema NAME``: the JSON Schema of a file a user writes."""

from __future__ import annotations

import typer

from govray.core.errors import ConfigError


def schema(
    name: str = typer.Argument(..., help="experiment, policy, trust, settings or serve."),
) -> None:
    """Print the JSON Schema of a file you write (experiment, policy, trust, settings, serve).

    The same schemas lie in docs/schemas/ (docs/reference.md renders them): put
    `# yaml-language-server: $schema=PATH` on a YAML file's first line and an editor flags what
    govray would refuse.
    """
    from govray.config.schemas import DOCUMENTS, schema_text

    if name not in DOCUMENTS:
        raise ConfigError(f"no schema '{name}' (one of: {', '.join(DOCUMENTS)})")
    typer.echo(schema_text(name), nl=False)
