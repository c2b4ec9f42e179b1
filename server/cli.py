"""The `sluice` command: serve, and the subcommands that live in their own packages."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

import click

from engine.settings import SettingsError, load_settings

# Subcommands imported only when used, so `sluice serve` never imports torch or locust.
LAZY_COMMANDS = {
    "convert": "converters.cli:convert",
    "keys": "server.keys:keys",
    "loadtest": "loadtests.cli:loadtest",
    "bundle": "server.bundle:bundle",
}


class SluiceGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY_COMMANDS:
            module, _, attr = LAZY_COMMANDS[name].partition(":")
            try:
                command: click.Command = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                return _unavailable(name, exc)
            return command
        return super().get_command(ctx, name)


def _unavailable(name: str, exc: Exception) -> click.Command:
    """A stand-in that says why a subcommand cannot run (e.g. an extra is not installed)."""

    def fail() -> None:
        raise click.ClickException(
            f"'sluice {name}' is not available: {exc} (install the matching extra, see README)"
        )

    return click.Command(name, callback=fail, help=f"(unavailable: {exc})")


@click.group(cls=SluiceGroup)
@click.version_option("0.1.0", prog_name="sluice")
def main() -> None:
    """sluice: a high-concurrency inference server for ONNX models."""


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Server settings YAML file.",
)
@click.option(
    "--model-repository",
    type=click.Path(path_type=Path, file_okay=False),
    help="Model repository folder (default: the built-in demo model).",
)
@click.option("--host", help="Address to bind (default 127.0.0.1).")
@click.option("--http-port", type=int, help="HTTP port (default 8000).")
@click.option("--grpc-port", type=int, help="gRPC port (default 8001).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", type=click.Choice(["json", "text"]))
@click.option("--model-control-mode", type=click.Choice(["none", "explicit", "poll"]))
@click.option(
    "--load-model",
    "load_models",
    multiple=True,
    help="Model to load at start in explicit mode (repeatable; '*' for all).",
)
@click.option("--drain-timeout-s", type=float, help="Seconds to finish requests on SIGTERM.")
@click.option(
    "--allow-unauthenticated",
    is_flag=True,
    default=None,
    help="Allow a non-loopback bind with no API keys configured.",
)
def serve(config_file: Path | None, **flags: Any) -> None:
    """Serve models over HTTP and gRPC (KServe v2 / Triton protocols)."""
    from server.logs import configure_logging
    from server.server import Server

    flags["load_models"] = list(flags["load_models"]) or None
    try:
        settings = load_settings(config_file, **flags)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    configure_logging(settings.log_level, settings.log_format)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.Runner()
    try:
        with runner:
            runner.run(Server(settings).serve())
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(0)
