"""A command group that imports a subcommand's module only when that subcommand runs.

The subcommands' modules reach torch, Ray, Ray Data and pyarrow (seconds to import), which
``govray --help`` and the commands that only read the tracking store never use. So the top level
knows each subcommand by a ``Subcommand`` entry: where its code lives and the summary its listing
shows. Listing (``govray --help``) reads only the entries; running a subcommand, or asking for its
own ``--help``, imports its module and builds it exactly as ``add_typer`` / ``command`` would.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    from typer._click import Command, Context, HelpFormatter  # typer vendors click as typer._click


@dataclass(frozen=True)
class Subcommand:
    """Where a subcommand's code lives, and what ``govray --help`` says of it."""

    target: str  # "module:attribute": a typer.Typer (a command group) or a function (a command)
    summary: str  # the first paragraph of its help, as its own --help shows it
    hidden: bool = False


def load(name: str, subcommand: Subcommand, parent: TyperGroup) -> Command:
    """Import ``subcommand``'s module and build its command as ``parent``'s typer.Typer would have
    with ``add_typer`` or ``command`` (inheriting its markup mode and suggestions)."""
    module, _, attribute = subcommand.target.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    holder = typer.Typer(rich_markup_mode=parent.rich_markup_mode, suggest_commands=parent.suggest_commands)
    if isinstance(found, typer.Typer):
        holder.add_typer(found, name=name, hidden=subcommand.hidden)
    else:
        holder.command(name=name, hidden=subcommand.hidden)(found)
    return typer.main.get_group(holder).commands[name]


class StandIn(TyperCommand):
    """A subcommand not imported yet: its name and summary, for listings."""


class LazyGroup(TyperGroup):
    """A TyperGroup whose subcommands are imported the first time one is resolved.

    A subclass names them (``subcommands``, in listing order); ``typer.Typer(cls=SUBCLASS, ...)``
    builds the group.
    """

    subcommands: ClassVar[dict[str, Subcommand]] = {}

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        # Stand-ins until loaded: the names stay known to listings and to "Did you mean ...?".
        self.commands = {
            name: StandIn(name, help=entry.summary, hidden=entry.hidden)
            for name, entry in self.subcommands.items()
        }
        self._listing = False

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if not self._listing and isinstance(self.commands.get(cmd_name), StandIn):
            self.commands[cmd_name] = load(cmd_name, self.subcommands[cmd_name], self)
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        """The listing reads the stand-ins (name and summary), so it imports no subcommand."""
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False
