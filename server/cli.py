"""The `sluice` command: serve, and the subcommands that live in their own packages."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from engine.settings import SettingsError
from server.settings import load_settings

# Subcommands imported only when used, so `sluice serve` never imports torch or locust.
LAZY_COMMANDS = {
    "convert": "converters.cli:convert",
    "keys": "server.keys:keys",
    "loadtest": "loadtests.cli:loadtest",
    "tune": "loadtests.tune.cli:tune",
    "bundle": "server.bundle:bundle",
}
EXTRAS = {
    "convert": ("convert", ("torch", "onnxscript", "onnxslim", "skl2onnx", "sklearn")),
    "loadtest": ("loadtest", ("locust", "matplotlib", "httpx")),
    "tune": ("loadtest", ("locust", "matplotlib", "httpx")),
}
"""Subcommands that need an optional extra: (extra, the modules it installs that they import)."""


class UnavailableCommand(click.ClickException):
    """A subcommand that cannot run here; a usage problem (exit 2), not a failed run."""

    exit_code = 2


class SluiceGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        extra, modules = EXTRAS.get(name, ("", ()))
        # find_spec, not import: importing locust would patch this process with gevent.
        missing = [module for module in modules if importlib.util.find_spec(module) is None]
        if missing:
            return _unavailable(
                name,
                f"'sluice {name}' needs the {extra} extra, which is not installed "
                f"(missing: {', '.join(missing)}): pip install 'sluice[{extra}]'",
                f"(needs: pip install 'sluice[{extra}]')",
            )
        module, _, attr = LAZY_COMMANDS[name].partition(":")
        try:
            command: click.Command = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            return _unavailable(name, f"'sluice {name}' is not available: {exc}", f"({exc})")
        return command


def _unavailable(name: str, message: str, short_help: str) -> click.Command:
    """A stand-in that takes any arguments (the real command's options are unknown here) and
    says why the subcommand cannot run, --help included."""

    def fail() -> None:
        raise UnavailableCommand(message)

    return click.Command(
        name,
        callback=fail,
        help=message,
        short_help=short_help,
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


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
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Least severe log level written (default info).",
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "text"]),
    help="JSON lines or plain text logs; auto (default): text when stderr is a terminal, "
    "else JSON.",
)
@click.option(
    "--model-control-mode",
    type=click.Choice(["none", "explicit", "poll", "on_demand"]),
    help="none: load every model at start (default); explicit: load --load-model models, then "
    "what the repository API asks; poll: also rescan the repository; on_demand: load a model "
    "on its first request, within the model_memory budget.",
)
@click.option(
    "--load-model",
    "load_models",
    multiple=True,
    help="Model to load at start in explicit mode (repeatable; '*' for all).",
)
@click.option("--drain-timeout-s", type=float, help="Seconds to finish requests on SIGTERM.")
@click.option(
    "--workers",
    help="Front-end worker processes sharing the ports, in front of one engine process: a "
    "number, or 'auto' (one per core, at most 8). Default 1: one process.",
)
@click.option(
    "--strict-readiness/--no-strict-readiness",
    default=None,
    help="Ready only while every model asked for serves (default); or once started.",
)
@click.option(
    "--allow-unauthenticated",
    is_flag=True,
    default=None,
    help="Allow a non-loopback bind with no API keys configured.",
)
@click.option(
    "--allow-python-models",
    is_flag=True,
    default=None,
    help="Load Python steps (model.py files in the repository run as server code).",
)
@click.option(
    "--tls-cert-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PEM certificate chain: HTTPS and gRPC TLS (with --tls-key-file).",
)
@click.option(
    "--tls-key-file", type=click.Path(path_type=Path, dir_okay=False), help="PEM private key."
)
@click.option(
    "--tls-client-ca-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PEM CA bundle for client certificates (mTLS; see tls.require_client_cert).",
)
def serve(config_file: Path | None, **flags: Any) -> None:
    """Serve models over HTTP and gRPC (KServe v2 / Triton protocols)."""
    from server.logs import configure_logging
    from server.server import Server

    flags["load_models"] = list(flags["load_models"]) or None
    tls = {
        name: value
        for name in ("cert_file", "key_file", "client_ca_file")
        if (value := flags.pop(f"tls_{name}")) is not None
    }
    flags["tls"] = tls or None  # merged with the tls section of the file and environment
    try:
        settings = load_settings(config_file, **flags)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    # Resolved once: the server's start line and forked workers see the format in use.
    log_format = configure_logging(settings.log_level, settings.log_format)
    settings = settings.model_copy(update={"log_format": log_format})
    from server.supervisor import worker_count

    if worker_count(settings) > 1:
        from server.supervisor import Supervisor

        try:
            sys.exit(Supervisor(settings).run())
        except SettingsError as exc:
            raise click.ClickException(str(exc)) from exc
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.Runner()
    try:
        with runner:
            server = Server(settings)
            runner.run(server.serve())
            if server.stopped_loading:  # a model's load still runs in a thread: not waited for
                logging.shutdown()
                os._exit(0)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(0)
