from __future__ import annotations

from typing import Any

import configargparse
import pytest

from loadtests.options import UserOptions, add_arguments, env_name


class _Parser(configargparse.ArgumentParser):  # type: ignore[misc]  # untyped library
    """configargparse with the two keyword arguments locust's parser adds (locust itself cannot
    be imported here: it monkey-patches the test process with gevent)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("is_secret", None)
        kwargs.pop("include_in_web_ui", None)
        return super().add_argument(*args, **kwargs)


def _parse(args: list[str], env: dict[str, str]) -> UserOptions:
    parser = _Parser()
    add_arguments(parser)
    return UserOptions.from_namespace(parser.parse_args(args, env_vars=env))


def test_env_round_trip_through_locusts_parser() -> None:
    options = UserOptions(
        model="demo",
        model_version="2",
        batch_size=4,
        dynamic_size=7,
        cache_hit_fraction=0.25,
        api_keys=("k1", "k2"),
        metadata={"name": "demo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}]},
        timeout_s=2.5,
        seed=11,
    )
    assert _parse([], options.to_env()) == options


def test_flags_win_over_environment() -> None:
    parsed = _parse(["--sluice-model", "flag"], {env_name("sluice-model"): "env"})
    assert parsed.model == "flag"


def test_env_names() -> None:
    assert env_name("sluice-cache-hit-fraction") == "SLUICE_LOADTEST_CACHE_HIT_FRACTION"


def test_missing_model_names_the_variable() -> None:
    with pytest.raises(ValueError, match="SLUICE_LOADTEST_MODEL"):
        _parse([], {})


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_out_of_range(fraction: float) -> None:
    with pytest.raises(ValueError, match=rf"cache hit fraction is {fraction}; allowed: 0.0 to 1.0"):
        UserOptions(model="m", cache_hit_fraction=fraction)


def test_keys_are_dealt_round_robin_and_labels_hide_them() -> None:
    options = UserOptions(model="m", api_keys=("a", "b", "c"))
    assert [options.api_key_for(i) for i in range(5)] == ["a", "b", "c", "a", "b"]
    assert options.tenant_label(4) == " [tenant 2]"
    single = UserOptions(model="m", api_keys=("a",))
    assert single.tenant_label(3) == ""
    assert UserOptions(model="m").api_key_for(0) is None


def test_blank_keys_are_dropped() -> None:
    assert _parse(
        [], {env_name("sluice-model"): "m", env_name("sluice-api-keys"): "a, ,b,"}
    ).api_keys == ("a", "b")
