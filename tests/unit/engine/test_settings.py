"""engine.settings: EngineSettings' own checks, `read_yaml`'s refusals and `describe`, one line
per bad key. (The server's root composes these fields with its own and reads them from YAML, the
environment and flags: tests/unit/server/test_settings.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.settings import EngineSettings, read_yaml
from tests.unit.engine.settings_files import error_of, write


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # describe() names a SLUICE_* variable that is set: the developer's shell must not count.
    for name in list(os.environ):
        if name.upper().startswith("SLUICE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("yaml_text", "type_name"),
    [("- a\n- b\n", "list"), ("just text\n", "str"), ("42\n", "int")],
)
def test_non_mapping_yaml_is_rejected(tmp_path: Path, yaml_text: str, type_name: str) -> None:
    path = write(tmp_path, yaml_text)
    message = error_of(path)
    assert str(path) in message
    assert f"expected a mapping at the top level, got {type_name}" in message


def test_invalid_yaml_syntax_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "http_port: [1, 2\n")
    message = error_of(path)
    assert message.startswith(f"cannot read {path}")


def test_an_empty_file_is_an_empty_mapping(tmp_path: Path) -> None:
    assert read_yaml(write(tmp_path, "# nothing set\n")) == {}
    assert read_yaml(write(tmp_path, "drain_timeout_s: 2\n")) == {"drain_timeout_s": 2}


def test_model_repository_must_be_a_directory(tmp_path: Path) -> None:
    message = error_of(model_repository=tmp_path / "nowhere")
    assert "model_repository" in message
    assert "is not a directory" in message
    assert EngineSettings(model_repository=tmp_path).model_repository == tmp_path


def test_describe_gives_one_line_per_problem_with_the_value_received() -> None:
    message = error_of(drain_timeout_s=-1, model_control_mode="lazy")
    assert message.splitlines() == [
        "invalid configuration in the test:",
        "  model_control_mode: Input should be 'none', 'explicit', 'poll' or 'on_demand' "
        "(got 'lazy')",
        "  drain_timeout_s: Input should be greater than or equal to 0 (got -1)",
    ]


def test_an_unknown_key_lists_the_keys_allowed_in_its_section() -> None:
    message = error_of(rate_limit={"default": {"rate": 5}})
    line = message.splitlines()[1]
    key, allowed = line.split(": unknown key; allowed keys here: ")
    assert key == "  rate_limit.default.rate"
    assert allowed.split(", ")[:3] == ["burst", "max_concurrent", "max_queue_share"]
    assert "rate_per_s" in allowed.split(", ")
    top = error_of(drain_timeout=1).splitlines()[1]
    assert top.startswith("  drain_timeout: unknown key; allowed keys here: allow_python_models,")


def test_an_unknown_key_under_a_named_tenant_lists_the_tenant_keys() -> None:
    line = error_of(rate_limit={"tenants": {"acme": {"rate": 5}}}).splitlines()[1]
    assert line.startswith("  rate_limit.tenants.acme.rate: unknown key; allowed keys here: burst,")


def test_a_key_set_from_the_environment_is_named_with_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_CACHE__MEMORY_BYTES", "0")
    message = error_of(cache={"memory_bytes": 0})
    assert "  cache.memory_bytes (from SLUICE_CACHE__MEMORY_BYTES): Input should be greater" in (
        message
    )
