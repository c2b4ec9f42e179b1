"""How many workers `workers` means (server/supervisor.py); the processes themselves are tested
end to end in tests/integration/test_workers.py."""

from __future__ import annotations

import os

import pytest

from engine.settings import SettingsError, load_settings
from server.supervisor import MAX_AUTO_WORKERS, worker_count


def test_a_number_is_taken_as_it_is() -> None:
    assert worker_count(load_settings(workers=3)) == 3


def test_auto_is_one_per_usable_core_at_most_eight() -> None:
    cores = len(os.sched_getaffinity(0))
    assert worker_count(load_settings(workers="auto")) == min(cores, MAX_AUTO_WORKERS)


@pytest.mark.parametrize("bad", [0, 65, "many"])
def test_a_bad_count_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(SettingsError, match="workers"):
        load_settings(workers=bad)
