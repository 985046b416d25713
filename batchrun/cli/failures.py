"""How every command fails: one `Error:` line (and a JSON object for a command given --json), never a traceback."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from batchrun.errors import user_errors
from batchrun.host import Stopped, one_line, redacted, save_traceback, secrets_in, stop_signals_unwind

_COMMAND_KEY = "batchrun.command"  # ctx.meta: the subcommand named and the arguments it was given


class FriendlyErrors(click.Group):
    """Every failure ends in one `Error:` line, never a traceback: a foreseen one (a BatchrunError) says what to do;
    any other is a fault in batchrun, said as such, its traceback kept in a log file the line names. A command given
    --json also prints one JSON object on stdout when it fails ({"error", "kind", "exit_code"}, and "log" for an
    unforeseen failure), so a script always has something to parse."""

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[_COMMAND_KEY] = (name, command, list(rest))  # a copy: parsing consumes the list it is given
        return name, command, rest

    def invoke(self, ctx):
        try:
            with stop_signals_unwind():
                return super().invoke(ctx)
        except user_errors() as exc:
            _json_failure(ctx, str(exc), type(exc).__name__, 1)
            click.echo(f"Error: {exc}", err=True)
            sys.exit(1)
        except (click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise  # click's own ways out: --help, an aborted prompt, a reader that closed the pipe
        except click.ClickException as exc:  # a usage error: click prints it and exits 2
            _json_failure(ctx, exc.format_message(), "usage", exc.exit_code)
            raise
        except KeyboardInterrupt as exc:
            resume = ("; committed passes are kept: run the same command again to resume"
                      if ctx.invoked_subcommand == "submit" else "")
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            how = "Interrupted" if signum == signal.SIGINT else f"Stopped by {signal.Signals(signum).name}"
            _json_failure(ctx, f"{how}{resume}", "interrupted", 128 + signum)
            click.echo(f"\n{how}{resume}.", err=True)
            sys.exit(128 + signum)  # the shell's code for a command ended by that signal (130 for Ctrl-C)
        except Exception as exc:  # noqa: BLE001 - unforeseen: said in one line, its traceback kept in a file
            secrets = secrets_in(ctx.meta.get(_COMMAND_KEY, (None, None, []))[2])
            log = save_traceback(exc, secrets)
            message = redacted(_unforeseen_message(exc, log, ctx.invoked_subcommand), secrets)
            _json_failure(ctx, message, "internal", 1, log=log and str(log))
            click.echo(f"Error: {message}", err=True)
            sys.exit(1)


def _unforeseen_message(error: Exception, log: Path | None, command: str | None) -> str:
    said = one_line(str(error))
    where = f"its traceback is in {log}, which a bug report should include" if log else \
        "its traceback could not be written: no writable directory"
    message = f"unexpected {type(error).__name__}{f': {said}' if said else ''} (a fault in batchrun; {where})"
    if command in ("submit", "compare"):
        message += ". Answers committed before the failure are kept"
    return message


def _json_failure(ctx: click.Context, message: str, kind: str, exit_code: int, **extra) -> None:
    if _wants_json(ctx):
        click.echo(json.dumps({"error": message, "kind": kind, "exit_code": exit_code, **extra}))


def _wants_json(ctx: click.Context) -> bool:
    """Whether the command that failed was given --json, read again from its arguments: a failure may come before
    or while click parses them, and an unknown option before --json must not hide it."""
    name, command, args = ctx.meta.get(_COMMAND_KEY, (None, None, []))
    while isinstance(command, click.Group) and args:  # `db check --json`
        name, command, args = args[0], command.get_command(ctx, args[0]), args[1:]
    if command is None or not any(param.name == "as_json" for param in command.params):
        return False
    try:
        parsed = command.make_context(name, list(args), parent=ctx, resilient_parsing=True,
                                      ignore_unknown_options=True)
    except click.ClickException:
        return "--json" in args
    return bool(parsed.params.get("as_json"))
