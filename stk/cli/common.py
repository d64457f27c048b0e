"""What every stk command shares: --config, verbosity, the S3 endpoint, and the way a command
ends (one readable line and a documented exit code, never a traceback for expected errors)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from stk import storage
from stk.cluster.world import World, exit_now, failed_rank, get_world, raised_on_every_rank
from stk.config import load_command_config
from stk.errors import ExitCode, StkError
from stk.log import get_logger, setup_logging
from stk.storage.failures import storage_errors

__all__ = [
    "CONFIG_FILE",
    "CONTEXT",
    "FiniteFloat",
    "common_options",
    "config_option",
    "default_of",
    "max_errors_option",
    "option_group",
    "options_from",
    "quiet_option",
    "run_command",
    "run_process",
    "s3_options",
    "set_option_defaults",
    "verbosity_options",
]

F = TypeVar("F", bound=Callable[..., Any])
CONFIG_FILE = "stk.config_file"  # the --config file's path, in click's context meta
T = TypeVar("T")
log = get_logger("cli")


class FiniteFloat(click.FloatRange):
    """Every float option's type (and its config key's and environment variable's): a finite number, within the
    bounds if given. Python's float() reads "nan" and "inf", which click's FloatRange lets through (nan compares
    false to any bound): `--lr nan` then failed deep in the optimizer and `--lr inf` trained to non-finite weights.
    Refused here, they are a usage error (exit 2) naming the option."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        """No range in the help of an option without bounds (click's would print "x<=None")."""
        return super()._describe_range() if self.min is not None or self.max is not None else ""


def CONTEXT(command: str) -> dict[str, Any]:
    """click context settings: STK_<COMMAND>_<OPTION> environment variables, -h for help."""
    return {"auto_envvar_prefix": f"STK_{command.upper()}", "help_option_names": ["-h", "--help"], "show_default": True}


def _load_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        ctx.meta[CONFIG_FILE] = value  # for a command that reads more of the file than its table (stk-scan's datasets)
        # the table is named after the command: STK_CACHE -> [cache], whatever the subcommand
        command = (ctx.auto_envvar_prefix or "").removeprefix("STK_").lower()
        try:
            settings = load_command_config(value, command)
        except StkError as exc:
            raise click.BadParameter(str(exc)) from exc
        set_option_defaults(ctx, settings, value, command)
    return value


def set_option_defaults(ctx: click.Context, settings: dict[str, Any], path: str, table: str) -> None:
    """Config values become the command's defaults (so the command line and the environment
    still win); a key that names no option is an error, not silently ignored. A subcommand
    (stk-cache verify) shares its table with its siblings, so their options are known too."""
    commands = [ctx.command]
    if ctx.parent is not None and isinstance(ctx.parent.command, click.Group):
        commands += ctx.parent.command.commands.values()
    known = {p.name for command in commands for p in command.params if p.name} - {"config"}
    unknown = sorted(set(settings) - known)
    if unknown:
        names = ", ".join(k.replace("_", "-") for k in unknown)
        raise click.BadParameter(f"{path}: unknown key(s) in [{table}]: {names}")
    ctx.default_map = {**(ctx.default_map or {}), **settings}


def config_option(
    callback: Callable[[click.Context, click.Parameter, str | None], str | None] = _load_config,
    help: str = "TOML file; its table named after the command sets defaults for any option.",
) -> Callable[[F], F]:
    """--config: read before the other options, so its values become their defaults."""
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=callback,
        show_envvar=True,
        help=help,
    )


def quiet_option(fn: F) -> F:
    return click.option("-q", "--quiet", is_flag=True, help="Warnings and errors only.")(fn)


def verbosity_options(fn: F) -> F:
    """-v (debug) and -q (warnings and errors only)."""
    return click.option("-v", "--verbose", count=True, help="More log output (debug).")(quiet_option(fn))


def s3_options(fn: F) -> F:
    """The S3 endpoint and retry budget, for every command that may read or write s3:// paths."""
    fn = click.option(
        "--s3-retry-seconds",
        default=storage.DEFAULT_RETRY_SECONDS,
        type=FiniteFloat(0),
        show_envvar=True,
        help="How long S3 may stop answering (connection errors, timeouts, 5xx, throttling) before the "
        "command gives up with exit 69.",
    )(fn)
    return click.option(
        "--s3-endpoint-url",
        default=None,
        show_envvar=True,
        help="S3-compatible endpoint (MinIO, R2, SeaweedFS). Credentials come from boto3's usual chain "
        "(environment, profile, instance role), never from options.",
    )(fn)


def common_options(fn: F) -> F:
    """--config, -v/-q and the S3 options: what stk-scan, stk-cache, stk-train and stk-launch share."""
    return config_option()(verbosity_options(s3_options(fn)))


def option_group(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """Several options as one decorator, listed in --help in the order given, so that a command with many options
    can keep them in modules by what they are about."""

    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def default_of(options: type[Any], name: str) -> Any:
    """The library's default for one field of an options dataclass, so that a click option states
    no default of its own and the two can never disagree."""
    found = next(f for f in dataclasses.fields(options) if f.name == name)
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    if found.default is dataclasses.MISSING:
        raise TypeError(f"{options.__name__}.{name} has no default")
    return found.default


def options_from(options: type[T], params: dict[str, Any], **converted: Any) -> T:
    """An options dataclass from a command's click parameters named like its fields, with
    `converted` (values click cannot produce as they are: enums, nested settings) over them."""
    names = {f.name for f in dataclasses.fields(options)}  # type: ignore[arg-type]
    return options(**{**{k: v for k, v in params.items() if k in names}, **converted})


def max_errors_option(what: str, options: type[Any]) -> Callable[[F], F]:
    """--max-errors, one option for stk-scan and stk-cache (parsed by stk.errors.parse_max_errors),
    its default the `options` dataclass's."""
    return click.option(
        "--max-errors",
        default=default_of(options, "max_errors"),
        show_envvar=True,
        help=f"Bad {what} tolerated: a count or a percentage of the {what}; more fail the command (exit 4).",
    )


def run_command(
    name: str,
    verbose: int,
    quiet: bool,
    s3_endpoint_url: str | None,
    body: Callable[[World], int | None],
    failure_code: int | None = None,
    per_node: bool = False,
    s3_retry_seconds: float = storage.DEFAULT_RETRY_SECONDS,
) -> None:
    """Set up the world and logging, run `body`, and exit with its code or the error's code.

    `failure_code` replaces the exit code of every failure: stk-health must exit 3 (UNKNOWN) when it
    cannot tell, since 1 and 2 mean WARNING and CRITICAL to cron, Slurm and monitoring. A `per_node`
    command (stk-health) is one process on its node whatever launched it, never an MPI rank."""
    try:
        world = World() if per_node else get_world()
    except StkError as exc:
        click.echo(f"{name}: error: {exc}", err=True)
        sys.exit(int(exc.exit_code if failure_code is None else failure_code))
    setup_logging(name, world, -1 if quiet else verbose)
    storage.configure_s3(s3_endpoint_url, s3_retry_seconds)
    try:
        with storage_errors():  # a full, read-only or forbidden disk anywhere: one line, not a traceback
            code = body(world) or ExitCode.OK
    except StkError as exc:
        code = exc.exit_code if failure_code is None else failure_code
        if world.size == 1 or raised_on_every_rank(exc):
            # every rank has it and ends by itself: rank 0 says it once
            if world.is_root:
                origin = failed_rank(exc)
                _log_lines(str(exc), "" if origin is None or origin[0] == 0 else _where(*origin))
        else:  # this rank alone: its peers would wait for it in their next collective forever
            _log_lines(f"{exc} (stopping all {world.size} ranks)", _where(world.rank, world.node))
            world.abort(code)
    except KeyboardInterrupt:
        log.error("interrupted; rerun the same command to continue where it stopped")
        code = 130
    except Exception:
        log.exception("unexpected error (a bug): please report it with this log")
        world.abort(ExitCode.INTERNAL)
        code = ExitCode.INTERNAL if failure_code is None else failure_code
    else:
        sys.stdout.flush()
        sys.exit(int(code))
    if world.size == 1 and _whole_process():
        # A failed process ends without the interpreter's and C++'s teardown: a library's native thread still
        # alive then (seen after stk-cache's disk errors: "terminate called without an active exception") would
        # turn the documented code into SIGABRT. What it wrote is whole or not there; its log lines are out.
        exit_now(int(code))
    sys.stdout.flush()
    sys.exit(int(code))


class _WholeProcess:
    """click's context object of a command that is its process's whole life (run_process), not a call
    inside another program (a test's CliRunner, stk-launch's rank)."""


def run_process(command: click.Command, prog_name: str) -> NoReturn:
    """Run `command` as the executable `prog_name` (console script, `python -m`, bin/): run_command may then end
    the process at once when it fails."""
    command.main(prog_name=prog_name, obj=_WholeProcess())
    sys.exit(0)  # click's standalone mode has exited already


def _whole_process() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.find_object(_WholeProcess) is not None


def _where(rank: int, node: str | None) -> str:
    return f"rank {rank} on {node}: " if node else f"rank {rank}: "


def _log_lines(text: str, where: str) -> None:
    """An error as it reaches the log: each of its lines, the first one saying which rank had it
    (unless the message already does)."""
    lines = text.splitlines() or [""]
    if where and not lines[0].startswith(where.rstrip(": ")):
        lines[0] = where + lines[0]
    for line in lines:
        log.error("%s", line)
