"""engine.facade: the Engine and a worker's RemoteEngine implement every member of EngineFacade
with the same signature."""

from __future__ import annotations

import inspect

import pytest

from engine.engine import Engine
from engine.facade import EngineFacade
from server.link.remote import RemoteEngine
from server.settings import Settings

MEMBERS = sorted(name for name in vars(EngineFacade) if not name.startswith("_"))
METHODS = [name for name in MEMBERS if not isinstance(vars(EngineFacade)[name], property)]


def same_signature(implementation: type, name: str) -> None:
    declared = vars(EngineFacade)[name]
    implemented = getattr(implementation, name)
    assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared)
    assert str(inspect.signature(implemented)) == str(inspect.signature(declared))


@pytest.mark.parametrize("name", MEMBERS)
def test_engine_has_each_member_with_the_same_signature(name: str) -> None:
    if isinstance(vars(EngineFacade)[name], property):  # an attribute: held or computed
        assert hasattr(Engine(Settings()), name)
        return
    same_signature(Engine, name)


@pytest.mark.parametrize("name", METHODS)
def test_the_remote_engine_has_each_method_with_the_same_signature(name: str) -> None:
    """What a worker's front-ends await must be a coroutine there too: a sync one blocked the
    worker's event loop for as long as the engine process took to answer."""
    same_signature(RemoteEngine, name)


def test_the_facade_has_the_members_the_front_ends_use() -> None:
    assert {"infer", "input_check", "authenticator", "usage", "draining"} <= set(MEMBERS)
