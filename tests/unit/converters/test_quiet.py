"""converters.quiet: third-party warnings and log chatter are kept out of a conversion step."""

from __future__ import annotations

import logging
import warnings

import pytest

from converters.quiet import quiet


def test_warnings_and_chatter_are_silenced_and_the_levels_restored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = logging.getLogger("torch.onnx")
    exporter.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with quiet():
                warnings.warn("deprecated exporter path", DeprecationWarning, stacklevel=1)
                exporter.info("exporting graph")
                exporter.error("export failed")
            warnings.warn("after the step", UserWarning, stacklevel=1)
        assert [str(w.message) for w in shown] == ["after the step"]
        assert [r.getMessage() for r in caplog.records if r.name == "torch.onnx"] == [
            "export failed"
        ]
        assert exporter.level == logging.INFO
    finally:
        exporter.setLevel(logging.NOTSET)


def test_the_levels_come_back_when_the_step_fails() -> None:
    root = logging.getLogger()
    before = root.level
    during: list[int] = []

    def step() -> None:
        with quiet():
            during.append(root.level)
            raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        step()
    assert during == [logging.ERROR]
    assert root.level == before
