"""stk-health: click wiring only; the work is in stk.health. Never imports torch: it runs from
cron every minute and as Slurm's HealthCheckProgram, where start-up time matters."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import click

from stk.cli.common import CONTEXT, FiniteFloat, config_option, quiet_option, run_command, set_option_defaults
from stk.cluster.world import World
from stk.config import load_command_config
from stk.errors import StkError
from stk.health.check import expected_gpus_from_env, report_json_lines, report_text
from stk.health.devices import backend_from_env
from stk.health.report import Severity
from stk.health.rules import Thresholds
from stk.health.run import HealthPass, PassSettings, default_state_path

EPILOG = """\b
Examples:
  stk-health check                                   # JSON lines, exit 0/1/2/3
  stk-health check --format text --drain             # Slurm HealthCheckProgram
  stk-health check --notify-config /etc/stk/apprise.yml | jq -c 'select(.severity != "OK")'
  stk-health watch --interval 30 --notify 'slack://T/B/C'

\b
Exit codes (Nagios): 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN (no NVIDIA driver, bad options).
"""


def _settings_from_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """[health] table into click defaults; its [health.thresholds] sub-table into Thresholds."""
    if value:
        try:
            table = load_command_config(value, "health", with_s3=False)
            thresholds = table.pop("thresholds", None)
            ctx.meta["thresholds"] = Thresholds.from_dict(thresholds or {})
        except StkError as exc:
            raise click.BadParameter(str(exc)) from exc
        set_option_defaults(ctx, table, value, "health")
    return value


def _options(fn: Any) -> Any:
    options = [
        config_option(_settings_from_config, "TOML file: a [health] table of options and [health.thresholds]."),
        click.option(
            "--expected-gpus",
            type=click.IntRange(0),
            default=None,
            show_envvar=True,
            help="GPUs this node must show [default: from the Slurm allocation; unchecked outside Slurm].",
        ),
        click.option(
            "--format",
            "output",
            type=click.Choice(["json", "text"]),
            default="json",
            show_envvar=True,
            help="json: a line per finding, then a summary; text: one line (Slurm's Reason=).",
        ),
        click.option(
            "--notify",
            multiple=True,
            show_envvar=True,
            help="Apprise URL to alert (repeatable). Prefer --notify-config: URLs hold secrets.",
        ),
        click.option(
            "--notify-config",
            type=click.Path(dir_okay=False),
            default=None,
            show_envvar=True,
            help="Apprise config file (YAML or text) with the alert URLs.",
        ),
        click.option(
            "--state",
            "state_path",
            default=None,
            show_envvar=True,
            help="State file: what was alerted, and the last samples [default: /var/lib/stk-health/state.json "
            "as root, else ~/.cache/stk-health/state.json].",
        ),
        click.option(
            "--realert",
            type=FiniteFloat(0),
            default=4.0,
            show_envvar=True,
            help="Hours between repeated alerts while a fault persists (0: never repeat).",
        ),
        click.option(
            "--drain",
            is_flag=True,
            show_envvar=True,
            help='On CRITICAL, drain this Slurm node (Reason="stk-health: ..."); resume it when healthy, '
            "only if stk-health drained it.",
        ),
        quiet_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _settings(ctx: click.Context, params: dict[str, Any]) -> PassSettings:
    expected = params["expected_gpus"]
    return PassSettings(
        expected_gpus=expected if expected is not None else expected_gpus_from_env(),
        thresholds=ctx.meta.get("thresholds", Thresholds()),
        notify=tuple(params["notify"]),
        notify_config=params["notify_config"],
        state_path=params["state_path"] or default_state_path(),
        realert_hours=params["realert"],
        drain=params["drain"],
    )


def _print(report: Any, output: str) -> None:
    sys.stdout.write(report_json_lines(report) if output == "json" else report_text(report) + "\n")
    sys.stdout.flush()


@click.group("health", context_settings=CONTEXT("health"), epilog=EPILOG)
def cli() -> None:
    """GPU health checks for cron, Slurm and the training loop, with alerts that arrive once."""


def main() -> None:
    """The stk-health entry point: a bad option exits 3 (UNKNOWN), never click's 2, which cron,
    Slurm and monitoring would read as CRITICAL."""
    try:
        cli(prog_name="stk-health", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(int(Severity.UNKNOWN))
    except click.Abort:
        sys.exit(int(Severity.UNKNOWN))


@cli.command("check", context_settings=CONTEXT("health"), epilog=EPILOG)
@_options
@click.pass_context
def check(ctx: click.Context, **params: Any) -> None:
    """Check every GPU of this node once; print findings; exit with the worst severity."""
    settings = _settings(ctx, params)

    def body(world: World) -> int:
        report = HealthPass(backend_from_env(), settings).run()
        _print(report, params["output"])
        return int(report.severity)

    run_command("stk-health", 0, params["quiet"], None, body, failure_code=Severity.UNKNOWN, per_node=True)


@cli.command("watch", context_settings=CONTEXT("health"), epilog=EPILOG)
@click.option("--interval", type=FiniteFloat(min=1), default=60.0, show_envvar=True, help="Seconds between passes.")
@_options
@click.pass_context
def watch(ctx: click.Context, interval: float, **params: Any) -> None:
    """Check this node every --interval seconds until stopped (a node daemon); alerts on change."""
    settings = _settings(ctx, params)

    def body(world: World) -> int:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        health = HealthPass(backend_from_env(), settings)
        while True:
            started = time.monotonic()
            _print(health.run(), params["output"])
            time.sleep(max(0.0, interval - (time.monotonic() - started)))

    run_command("stk-health", 0, params["quiet"], None, body, failure_code=Severity.UNKNOWN, per_node=True)


if __name__ == "__main__":
    main()
