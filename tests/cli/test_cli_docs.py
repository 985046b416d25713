"""`batchrun --help` and docs/cli.md say the same: every option of every command is documented there and has help
text of its own, and every option the page's tables name is one a command takes."""
from __future__ import annotations

import re

import click

from batchrun.cli import cli
from tests.support import REPO_ROOT

CLI_DOC = (REPO_ROOT / "docs" / "cli.md").read_text()


def commands(group: click.Group = cli, prefix: str = "batchrun"):
    """(name, command) for every command under the group, subcommands included."""
    for name, command in sorted(group.commands.items()):
        yield f"{prefix} {name}", command
        if isinstance(command, click.Group):
            yield from commands(command, f"{prefix} {name}")


def options(command: click.Command):
    return [param for param in command.params if isinstance(param, click.Option)]


def test_every_option_of_every_command_is_documented_and_has_help():
    undocumented, without_help = [], []
    for name, command in commands():
        assert command.help, f"{name} has no help text"
        for option in options(command):
            long = max(option.opts, key=len)
            if f"`{long}" not in CLI_DOC:
                undocumented.append(f"{name} {long}")
            if not option.help:
                without_help.append(f"{name} {long}")
    assert not undocumented, f"options missing from docs/cli.md: {undocumented}"
    assert not without_help, f"options whose --help says nothing: {without_help}"


def test_every_option_the_page_documents_is_one_a_command_takes():
    taken = {opt for _, command in commands() for option in options(command) for opt in option.opts}
    documented = set(re.findall(r"^\| `(--[a-z][a-z0-9-]*)", CLI_DOC, re.M))
    documented |= set(re.findall(r"^\| `-[a-z]`, `(--[a-z][a-z0-9-]*)", CLI_DOC, re.M))
    assert documented, "no option table found in docs/cli.md"
    assert documented <= taken, f"documented but taken by no command: {sorted(documented - taken)}"
