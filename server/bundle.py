"""`sluice bundle`: one tarball that installs and serves sluice on a machine with no network.

The tarball holds one folder, `sluice-<version>/`:

    wheelhouse/          the sluice wheel and a binary wheel of every dependency for the target
    models/              the model repository (with --model-repository)
    config/server.yaml   the server config (with --config)
    install.sh           checks the files, makes a venv, `pip install --no-index`, prints the
                         serve command
    bundle.json          what was bundled, for whom
    SHA256SUMS           checksums of every file above
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import click

from engine.repository import Repository
from engine.settings import SettingsError, read_yaml
from server.settings import load_settings

EXTRAS = ("gpu", "convert", "loadtest")


class BundleError(Exception):
    """The bundle cannot be built; the message says what was found and what was needed."""


def this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def this_platform() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def locate_source() -> Path:
    """The source tree this sluice runs from (a checkout or an editable install)."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "sluice"' not in pyproject.read_text():
        raise BundleError(
            f"no sluice source tree at {root} (this is an installed sluice): "
            "pass --wheel with a built sluice wheel, or --source with a checkout"
        )
    return root


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise BundleError(f"`pip {args[0]}` failed (exit {result.returncode}):\n{tail}")


def build_wheel(source: Path, wheelhouse: Path) -> Path:
    """Build sluice's wheel from a clean copy of `source` into `wheelhouse`. setuptools builds in
    the tree it is given and packs its `build/lib` whole, so a module deleted since an earlier
    build (or one only ever built) would ship from there; the copy also leaves the checkout as
    it was (no build/, no egg-info)."""
    with tempfile.TemporaryDirectory() as scratch:
        clean = Path(scratch) / "source"
        _copy_buildable(source, clean)
        _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheelhouse), str(clean))
    wheels = sorted(wheelhouse.glob("sluice-*.whl"))
    if len(wheels) != 1:
        raise BundleError(f"expected one sluice wheel from {source}, found {len(wheels)}")
    return wheels[0]


def _copy_buildable(source: Path, destination: Path) -> None:
    """What the wheel is built from: the top level's files and the packages pyproject.toml
    includes ([tool.setuptools.packages.find]), without build output or caches; not the
    checkout's other folders (a model repository, a venv), which can be large."""
    found = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = found["packages"]["find"]["include"]
    destination.mkdir()
    for entry in source.iterdir():
        if entry.is_file():
            shutil.copy2(entry, destination / entry.name)
        elif entry.is_dir() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in include):
            shutil.copytree(entry, destination / entry.name, ignore=_NOT_SOURCE)


_NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "dist", "*.egg-info")


def download_dependencies(
    wheel: Path,
    wheelhouse: Path,
    *,
    python_version: str,
    platforms: tuple[str, ...],
    extras: tuple[str, ...],
    extra_index_urls: tuple[str, ...],
) -> None:
    """Binary wheels of everything `wheel` needs (and pip) for the target into `wheelhouse`.

    Binary only: an air-gapped host often has no compiler, so nothing may need building there."""
    requirement = (
        f"sluice[{','.join(extras)}] @ {wheel.resolve().as_uri()}" if extras else str(wheel)
    )
    target = ["--python-version", python_version, "--implementation", "cp"]
    for platform in platforms:
        target += ["--platform", platform]
    for url in extra_index_urls:
        target += ["--extra-index-url", url]
    _pip(
        "download",
        "--quiet",
        "--only-binary=:all:",
        "--dest",
        str(wheelhouse),
        *target,
        requirement,
        "pip",
    )


def copy_models(repository: Path, destination: Path) -> list[str]:
    """Copy a model repository (links followed) after checking that sluice can serve it."""
    try:
        found = Repository(repository).scan()
        names = Repository(repository).names()
    except (SettingsError, OSError) as exc:
        raise BundleError(f"model repository {repository}: {exc}") from exc
    empty = sorted(set(names) - set(found))
    if not found or empty:
        raise BundleError(
            f"model repository {repository}: no servable version in "
            f"{', '.join(empty) or 'any model folder'}; expected <name>/<version>/model.onnx"
        )
    try:
        shutil.copytree(repository, destination, symlinks=False)
    except shutil.Error as exc:  # every file that failed: (source, destination, why)
        failures = exc.args[0] if exc.args and isinstance(exc.args[0], list) else [exc]
        first = failures[0]
        why = f"{first[0]}: {first[2]}" if isinstance(first, tuple) and len(first) == 3 else first
        raise BundleError(
            f"model repository {repository}: {len(failures)} file(s) could not be copied; "
            f"the first: {why}"
        ) from exc
    except OSError as exc:
        raise BundleError(f"model repository {repository}: {exc}") from exc
    return sorted(found)


def copy_config(config_file: Path, destination: Path) -> None:
    """Copy the server config after checking it (its model_repository is the bundle's, so that
    key is left out of the check: the path need not exist on this machine)."""
    data = read_yaml(config_file)
    data.pop("model_repository", None)
    with tempfile.TemporaryDirectory() as scratch:
        checked = Path(scratch) / "server.yaml"
        checked.write_text(json.dumps(data))  # JSON is YAML
        try:
            load_settings(checked)
        except SettingsError as exc:
            raise BundleError(str(exc).replace(str(checked), str(config_file))) from exc
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_file, destination)


INSTALL_SH = """#!/bin/sh
# Installs sluice @VERSION@ from this bundle, with no network: ./install.sh [VENV]
# (default VENV: ./venv beside this script). PYTHON=/path/to/python@PYTHON@ picks the interpreter.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/venv}"
python="${PYTHON:-python3}"

if ! have="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; then
    echo "install.sh: cannot run $python; set PYTHON=/path/to/python@PYTHON@" >&2
    exit 1
fi
if [ "$have" != "@PYTHON@" ]; then
    echo "install.sh: this bundle is for Python @PYTHON@, $python is $have (set PYTHON=...)" >&2
    exit 1
fi
if command -v sha256sum >/dev/null 2>&1; then
    if ! (cd "$here" && sha256sum -c SHA256SUMS >/dev/null); then
        echo "install.sh: files differ from SHA256SUMS: the bundle is damaged" >&2
        exit 1
    fi
fi

"$python" -m venv "$venv"
# The wheelhouse alone: no index, and neither pip config files nor PIP_* variables of this host.
pip() {
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip --isolated --disable-pip-version-check \\
        "$@"
}
pip install --quiet --no-index --find-links "$here/wheelhouse" --upgrade pip
pip install --quiet --no-index --find-links "$here/wheelhouse" "sluice@EXTRAS@==@VERSION@"
@GPU@
echo "sluice @VERSION@ is installed in $venv. Serve with:"
echo "  $venv/bin/sluice serve@SERVE@"
"""

GPU_SWAP = """# onnxruntime-gpu replaces the CPU onnxruntime: both install the `onnxruntime` module.
pip uninstall --quiet --yes onnxruntime
pip install --quiet --no-index --find-links "$here/wheelhouse" --force-reinstall --no-deps \\
    onnxruntime-gpu
"""


def install_script(
    version: str, python_version: str, extras: tuple[str, ...], models: bool, config: bool
) -> str:
    serve = ""
    if config:
        serve += ' --config "$here/config/server.yaml"'
    if models:
        serve += ' --model-repository "$here/models"'
    replacements = {
        "@VERSION@": version,
        "@PYTHON@": python_version,
        "@EXTRAS@": f"[{','.join(extras)}]" if extras else "",
        "@GPU@": GPU_SWAP if "gpu" in extras else "",
        "@SERVE@": serve.replace('"', '\\"'),
    }
    text = INSTALL_SH
    for marker, value in replacements.items():
        text = text.replace(marker, value)
    return text


def write_checksums(folder: Path) -> None:
    lines = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append(f"{digest}  {path.relative_to(folder).as_posix()}\n")
    (folder / "SHA256SUMS").write_text("".join(lines))


def build_bundle(
    output: Path | None = None,
    *,
    wheel: Path | None = None,
    source: Path | None = None,
    model_repository: Path | None = None,
    config_file: Path | None = None,
    python_version: str | None = None,
    platforms: tuple[str, ...] = (),
    extras: tuple[str, ...] = (),
    extra_index_urls: tuple[str, ...] = (),
) -> Path:
    """Build the bundle tarball and return its path (see the module docstring for its layout)."""
    python_version = python_version or this_python()
    with tempfile.TemporaryDirectory(prefix="sluice-bundle-") as scratch:
        wheelhouse = Path(scratch) / "wheelhouse"
        wheelhouse.mkdir()
        if wheel is not None:
            wheel = Path(shutil.copy(wheel, wheelhouse))
        else:
            wheel = build_wheel(source or locate_source(), wheelhouse)
        version = wheel.name.split("-")[1]
        folder = Path(scratch) / f"sluice-{version}"
        folder.mkdir()
        download_dependencies(
            wheel,
            wheelhouse,
            python_version=python_version,
            platforms=platforms,
            extras=extras,
            extra_index_urls=extra_index_urls,
        )
        shutil.move(wheelhouse, folder / "wheelhouse")
        models = copy_models(model_repository, folder / "models") if model_repository else []
        if config_file is not None:
            copy_config(config_file, folder / "config" / "server.yaml")
        script = folder / "install.sh"
        script.write_text(
            install_script(version, python_version, extras, bool(models), config_file is not None)
        )
        script.chmod(0o755)
        manifest = {
            "sluice": version,
            "python": python_version,
            "platforms": list(platforms) or [this_platform()],
            "extras": list(extras),
            "models": models,
            "built": datetime.now(UTC).isoformat(timespec="seconds"),
            "wheels": sorted(p.name for p in (folder / "wheelhouse").iterdir()),
        }
        (folder / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
        write_checksums(folder)
        platform = (platforms or (this_platform(),))[0]
        name = f"sluice-{version}-py{python_version}-{platform}.tar.gz"
        output = output or Path.cwd() / name
        # Wheels are zip files already: more gzip effort buys nothing.
        with tarfile.open(output, "w:gz", compresslevel=1) as tar:
            tar.add(folder, arcname=folder.name)
    return output


@click.command("bundle")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Tarball to write (default: ./sluice-<version>-py<python>-<platform>.tar.gz).",
)
@click.option(
    "--model-repository",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Model repository to include (default: none; the bundle then serves the demo model).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Server config YAML to include.",
)
@click.option("--python-version", help="Target Python as X.Y (default: this interpreter's).")
@click.option(
    "--platform",
    "platforms",
    multiple=True,
    help="Target pip platform tag, e.g. manylinux2014_aarch64 (repeatable; default: this host).",
)
@click.option("--extra", "extras", multiple=True, type=click.Choice(EXTRAS), help="Extras.")
@click.option(
    "--extra-index-url",
    "extra_index_urls",
    multiple=True,
    help="Another package index to fetch from (e.g. NVIDIA's, for TensorRT with --extra gpu).",
)
@click.option(
    "--wheel",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A built sluice wheel to bundle (default: build one from the source tree).",
)
@click.option(
    "--source",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="sluice source tree to build the wheel from (default: the one running).",
)
def bundle(**options: object) -> None:
    """Build an air-gapped install bundle: wheels, models, config and install.sh in one tarball.

    On the target: tar xzf the tarball, run sluice-<version>/install.sh, then the command it
    prints."""
    click.echo("building the bundle (pip wheel + pip download)...", err=True)
    try:
        path = build_bundle(**options)  # type: ignore[arg-type]
    except BundleError as exc:
        raise click.ClickException(str(exc)) from exc
    size_mib = path.stat().st_size / (1024 * 1024)
    click.echo(f"wrote {path} ({size_mib:.0f} MiB)")
