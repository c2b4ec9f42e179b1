"""Choosing the optimization profile a batch runs on, and the errors for shapes none holds."""

from __future__ import annotations

import pytest

from engine.backends.tensorrt_profiles import Profiles
from engine.errors import InvalidInput

# Two buckets, as `sluice convert` builds them, and a wide profile overlapping both.
SMALL = {"x": ((1, 4), (4, 4), (4, 4)), "ids": ((1, 1), (4, 16), (4, 32))}
LARGE = {"x": ((5, 4), (8, 4), (8, 4)), "ids": ((5, 1), (8, 16), (8, 32))}
WIDE = {"x": ((1, 4), (8, 4), (8, 4)), "ids": ((1, 1), (8, 64), (8, 64))}


@pytest.mark.parametrize(
    ("x", "ids", "profile"),
    [
        ((3, 4), (3, 10), 0),  # only SMALL and WIDE hold it; SMALL's opt is nearer
        ((7, 4), (7, 16), 1),  # LARGE's opt is exact
        ((8, 4), (8, 40), 2),  # only WIDE allows a sequence of 40
        ((4, 4), (4, 40), 2),
    ],
)
def test_the_nearest_fitting_profile_is_chosen(
    x: tuple[int, ...], ids: tuple[int, ...], profile: int
) -> None:
    assert Profiles({0: SMALL, 1: LARGE, 2: WIDE}).choose({"x": x, "ids": ids}) == profile


def test_a_tie_goes_to_the_lower_index() -> None:
    assert Profiles({3: SMALL, 1: SMALL}).choose({"x": (2, 4), "ids": (2, 2)}) == 1


def test_a_pinned_profile_names_its_own_range() -> None:
    with pytest.raises(InvalidInput) as caught:
        Profiles({1: LARGE}).choose({"x": (2, 4), "ids": (2, 2)})
    assert str(caught.value) == (
        "input 'x' has shape [2, 4]; the TensorRT engine's optimization profile 1 allows "
        "[5, 4] to [8, 4]"
    )


def test_a_rank_the_profiles_lack_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"^input 'x' has shape \[2, 4, 1\]; .* profiles allow"):
        Profiles({0: SMALL, 1: LARGE}).choose({"x": (2, 4, 1), "ids": (2, 2)})


def test_inputs_that_fit_only_different_profiles_are_refused_naming_each() -> None:
    with pytest.raises(InvalidInput) as caught:
        Profiles({0: SMALL, 1: LARGE}).choose({"x": (3, 4), "ids": (6, 5)})
    assert str(caught.value) == (
        "inputs x [3, 4] and ids [6, 5] fit no single optimization profile of the TensorRT "
        "engine (profile 0 allows x [1, 4] to [4, 4] and ids [1, 1] to [4, 32]; profile 1 "
        "allows x [5, 4] to [8, 4] and ids [5, 1] to [8, 32])"
    )
