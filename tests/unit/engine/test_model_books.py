"""engine/model_books.py: what a request is told of a model from the books alone (the version it
goes to, or why none serves), without loading anything. The loads that fill the books are
test_registry.py's and test_on_demand.py's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.errors import InvalidInput, ModelNotFound, ModelNotReady
from engine.model_books import ModelBooks
from engine.repository import Repository


def version(name: str, number: str) -> Any:
    """A stand-in for a LoadedModel: the books read only its name and version."""
    return SimpleNamespace(name=name, version=number)


@pytest.fixture
def books(tmp_path: Path) -> ModelBooks:
    books = ModelBooks(Repository(tmp_path))
    books.serving["demo"] = {"1": version("demo", "1"), "2": version("demo", "2")}
    books.failures[("demo", "3")] = "InvalidGraph: half a model"
    books.failures[("broken", "1")] = "InvalidGraph: not an onnx model"
    books.loading.add("cold")
    return books


def test_no_version_named_is_the_highest_loaded(books: ModelBooks) -> None:
    assert books.resolve("demo", None) is books.serving["demo"]["2"]
    assert books.resolve("demo", "") is books.serving["demo"]["2"]
    assert books.resolve("demo", "1") is books.serving["demo"]["1"]


def test_a_model_loading_or_failed_is_not_ready_saying_which(books: ModelBooks) -> None:
    with pytest.raises(ModelNotReady, match=r"model 'cold' version 'latest' .*\(loading\)"):
        books.resolve("cold", None)
    with pytest.raises(ModelNotReady, match=r"'broken' version '1' .*failed to load: InvalidG"):
        books.resolve("broken", "1")


def test_a_version_that_failed_beside_serving_ones_is_not_ready(books: ModelBooks) -> None:
    with pytest.raises(ModelNotReady, match=r"version '3' .*failed to load: InvalidGraph"):
        books.resolve("demo", "3")


def test_unknown_models_and_versions_name_what_is_available(books: ModelBooks) -> None:
    with pytest.raises(ModelNotFound, match=r"unknown model 'other'; available: demo$"):
        books.resolve("other", None)
    with pytest.raises(
        ModelNotFound, match=r"unknown version '9' of model 'demo'; available: 1, 2"
    ):
        books.resolve("demo", "9")


@pytest.mark.parametrize(("name", "number"), [("../demo", None), ("demo", "../1")])
def test_a_name_that_is_no_name_is_invalid_input(
    books: ModelBooks, name: str, number: str | None
) -> None:
    with pytest.raises(InvalidInput, match=r"invalid (model|version) name '\.\./"):
        books.resolve(name, number)


def test_the_books_lookups(books: ModelBooks) -> None:
    serving = books.serving["demo"]["1"]
    assert (books.has("demo"), books.has("broken")) == (True, False)
    assert books.version_names("demo") == ("1", "2")
    assert (books.failed("broken"), books.failed("demo"), books.failed("cold")) == (
        True,
        True,
        False,
    )
    assert books.serves(serving) is True
    assert books.serves(version("demo", "1")) is False  # another load of the same version
    books.last_loaded["gone"] = {"1": version("gone", "1")}
    assert (books.known("demo"), books.known("gone"), books.known("cold")) == (True, True, False)
    assert [m.version for m in books.all()] == ["1", "2"]
    assert [m.name for m in books.all(known=True)] == ["gone", "demo", "demo"]
    books.clear_failures("demo")
    assert (books.failed("demo"), books.failed("broken")) == (False, True)
