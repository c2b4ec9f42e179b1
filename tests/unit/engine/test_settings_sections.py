"""engine.settings_sections: the nested sections' own rules (one tenant per key digest, limits
where the Redis script counts exactly, the memory budget's bounds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.settings_sections import MAX_LIMIT, TenantLimits
from tests.unit.engine.settings_files import error_of, load, write


def test_duplicate_api_key_digest_is_rejected(tmp_path: Path) -> None:
    digest = "sha256:" + "a" * 64
    text = (
        f"auth:\n  keys:\n    - digest: '{digest}'\n      tenant: one\n"
        f"    - digest: '{digest}'\n      tenant: two\n"
    )
    message = error_of(write(tmp_path, text))
    assert "listed twice" in message
    assert "'one'" in message
    assert "'two'" in message


@pytest.mark.parametrize("key", ["rate_per_s", "burst", "quota_per_day", "quota_per_month"])
@pytest.mark.parametrize("where", ["default", "tenants.acme.models.m"])
def test_limits_stop_where_the_redis_script_counts_exactly(
    tmp_path: Path, where: str, key: str
) -> None:
    # admit.lua counts in doubles, exact to 2^53: with a daily quota of 2^53 it admitted what
    # the memory backend refused (its reply was then called malformed), and past 2^53 it took
    # the counter for planted garbage and reset it.
    def config(value: int) -> Path:
        text = "rate_limit:\n"
        for depth, part in enumerate([*where.split("."), key], start=1):
            text += "  " * depth + part + (f": {value}\n" if part == key else ":\n")
        return write(tmp_path, text)

    message = error_of(config(2**53))
    assert (
        f"rate_limit.{where}.{key}: Input should be less than or equal to 9007199254740991 "
        "(got 9007199254740992)"
    ) in message
    limits = load(config(2**53 - 1)).rate_limit
    section = limits.default if where == "default" else limits.tenants["acme"].models["m"]
    assert getattr(section, key) == 2**53 - 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host_bytes", 0),
        ("gpu_bytes", -1),
        ("max_concurrent_loads", 0),
        ("load_queue_size", 0),
        ("load_wait_s", 0),
        ("idle_unload_s", 0),
    ],
)
def test_model_memory_bounds_name_the_key(key: str, value: int) -> None:
    assert f"model_memory.{key}" in error_of(model_memory={key: value})


def test_a_tenant_without_limits_is_unlimited_at_its_models_default_priority() -> None:
    limits = TenantLimits()
    assert (limits.rate_per_s, limits.burst, limits.quota_per_day) == (None, None, None)
    assert (limits.priority, limits.max_queue_share) == (0, 1.0)
    assert MAX_LIMIT == 9007199254740991


def test_every_section_refuses_unknown_keys_and_documents_every_field() -> None:
    import engine.settings_sections as sections

    classes = [
        value
        for value in vars(sections).values()
        if isinstance(value, type) and issubclass(value, sections.Section)
        and value is not sections.Section
    ]  # fmt: skip
    assert len(classes) == 9
    for section in classes:
        assert section.model_config.get("extra") == "forbid", section.__name__
        undocumented = [n for n, f in section.model_fields.items() if not f.description]
        assert undocumented == [], section.__name__
