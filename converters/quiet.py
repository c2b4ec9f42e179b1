"""Keep third-party chatter (exporter progress, deprecation warnings, quantizer log lines) out
of the conversion report; the step's own result says what happened."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence third-party warnings and log chatter (exporters, quantizers) during a step."""
    loggers = [logging.getLogger(name) for name in ("", "torch.onnx", "onnxscript", "skl2onnx")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
