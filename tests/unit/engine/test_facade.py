"""engine.facade: the Engine implements every member of EngineFacade with the same signature."""

from __future__ import annotations

import inspect

import pytest

from engine.engine import Engine
from engine.facade import EngineFacade
from engine.settings import Settings

MEMBERS = sorted(name for name in vars(EngineFacade) if not name.startswith("_"))


@pytest.mark.parametrize("name", MEMBERS)
def test_engine_has_each_member_with_the_same_signature(name: str) -> None:
    declared = vars(EngineFacade)[name]
    if isinstance(declared, property):  # an attribute: Engine may hold it or compute it
        assert hasattr(Engine(Settings()), name)
        return
    implemented = getattr(Engine, name)
    assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared)
    assert str(inspect.signature(implemented)) == str(inspect.signature(declared))


def test_the_facade_has_the_members_the_front_ends_use() -> None:
    assert {"infer", "input_check", "authenticator", "usage", "draining"} <= set(MEMBERS)
