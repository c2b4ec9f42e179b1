"""The model repository scan: numeric versions, version policies, names that are never paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import InvalidInput
from engine.repository import Repository, check_name
from engine.settings import SettingsError
from tests.models import identity_model, write_model

MODEL = identity_model("FP32")


def add_versions(repo: Path, name: str, versions: list[int], config: str | None = None) -> None:
    for version in versions:
        write_model(repo, name, MODEL, config, version=version)


@pytest.mark.parametrize(
    "name", ["demo", "a", "model_1", "resnet-50", "v1.2", "A.b-c_d", "_x", "9", "x" * 128]
)
def test_check_name_accepts(name: str) -> None:
    assert check_name("model", name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../x",
        "..%2Fx",
        "a/b",
        "a\\b",
        "/etc",
        "a b",
        " a",
        "a\n",
        "a\x00b",
        ".hidden",
        "-rf",
        "ünï",
        "x" * 129,
    ],
)
def test_check_name_rejects(name: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        check_name("model", name)
    assert caught.value.message.startswith(f"invalid model name {name!r}")
    assert "letters, digits" in caught.value.message


def test_check_name_says_which_kind() -> None:
    with pytest.raises(InvalidInput, match="invalid version name '1/2'"):
        check_name("version", "1/2")


def test_scan_finds_models_with_versions(tmp_path: Path) -> None:
    add_versions(tmp_path, "alpha", [1])
    add_versions(tmp_path, "beta", [1, 2])
    entries = Repository(tmp_path).scan()
    assert sorted(entries) == ["alpha", "beta"]
    assert entries["alpha"].versions == {1: tmp_path / "alpha" / "1" / "model.onnx"}
    assert list(entries["beta"].versions) == [2]  # default policy: latest 1


def test_only_numeric_version_folders_count(tmp_path: Path) -> None:
    add_versions(tmp_path, "m", [1, 2])
    for odd in ("abc", "1a", "-3", "v4", "1.5"):
        (tmp_path / "m" / odd).mkdir()
        (tmp_path / "m" / odd / "model.onnx").write_bytes(b"not a model")
    (tmp_path / "m" / "config.yaml").write_text("version_policy:\n  all: true\n")
    entry = Repository(tmp_path).entry("m")
    assert entry is not None
    assert sorted(entry.versions) == [1, 2]


def test_non_ascii_digit_folder_is_not_a_version(tmp_path: Path) -> None:
    # str.isdigit() is true for '²' and '٣', but int('²') raises: one such folder must not
    # break the scan of the whole repository.
    add_versions(tmp_path, "m", [1])
    for odd in ("²", "٣"):
        (tmp_path / "m" / odd).mkdir()
        (tmp_path / "m" / odd / "model.onnx").write_bytes(b"x")
    (tmp_path / "m" / "config.yaml").write_text("version_policy:\n  all: true\n")
    entries = Repository(tmp_path).scan()
    assert list(entries["m"].versions) == [1]


def test_version_folder_without_model_file_is_skipped(tmp_path: Path) -> None:
    add_versions(tmp_path, "m", [1])
    (tmp_path / "m" / "2").mkdir()  # empty: newest number, but nothing to serve
    (tmp_path / "m" / "3").mkdir()
    (tmp_path / "m" / "3" / "model.onnx").mkdir()  # a folder named like the file
    entry = Repository(tmp_path).entry("m")
    assert entry is not None
    assert list(entry.versions) == [1]


def test_model_without_any_model_file_is_not_served(tmp_path: Path) -> None:
    (tmp_path / "empty" / "1").mkdir(parents=True)
    add_versions(tmp_path, "ok", [1])
    repository = Repository(tmp_path)
    entry = repository.entry("empty")
    assert entry is not None
    assert entry.versions == {}
    assert sorted(repository.scan()) == ["ok"]


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("", [3]),
        ("version_policy:\n  latest: 2\n", [3, 2]),
        ("version_policy:\n  all: true\n", [3, 2, 1]),
        ("version_policy:\n  specific: [1, 3]\n", [3, 1]),
        ("version_policy:\n  specific: [2, 9]\n", [2]),
    ],
)
def test_version_policy_chooses_served_versions(
    tmp_path: Path, policy: str, served: list[int]
) -> None:
    add_versions(tmp_path, "m", [1, 2, 3], config=policy)
    entry = Repository(tmp_path).entry("m")
    assert entry is not None
    assert list(entry.versions) == served
    assert all(entry.versions[v] == tmp_path / "m" / str(v) / "model.onnx" for v in served)


def test_policy_serving_nothing_drops_the_model_from_scan(tmp_path: Path) -> None:
    add_versions(tmp_path, "m", [1, 2], config="version_policy:\n  specific: [5]\n")
    assert Repository(tmp_path).scan() == {}


def test_tensorrt_backend_looks_for_model_plan(tmp_path: Path) -> None:
    add_versions(tmp_path, "trt", [1], config="backend: tensorrt\n")
    (tmp_path / "trt" / "2").mkdir()
    (tmp_path / "trt" / "2" / "model.plan").write_bytes(b"engine")
    entry = Repository(tmp_path).entry("trt")
    assert entry is not None
    assert entry.versions == {2: tmp_path / "trt" / "2" / "model.plan"}


def test_names_skip_files_and_folders_with_bad_names(tmp_path: Path) -> None:
    add_versions(tmp_path, "good", [1])
    add_versions(tmp_path, "bad name", [1])
    add_versions(tmp_path, ".hidden", [1])
    (tmp_path / "README.md").write_text("not a model")
    repository = Repository(tmp_path)
    assert repository.names() == ["good"]
    assert sorted(repository.scan()) == ["good"]


def test_entry_of_missing_model_is_none(tmp_path: Path) -> None:
    assert Repository(tmp_path).entry("absent") is None


@pytest.mark.parametrize("name", ["..", "../outside", "a/../../b", "/etc"])
def test_entry_refuses_path_names_before_touching_disk(tmp_path: Path, name: str) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    add_versions(tmp_path, "outside", [1])  # a real model one level above the repository
    with pytest.raises(InvalidInput, match="invalid model name"):
        Repository(repo).entry(name)


def test_bad_config_yaml_fails_with_file_and_key(tmp_path: Path) -> None:
    add_versions(tmp_path, "m", [1], config="max_batch_size: -4\n")
    with pytest.raises(SettingsError) as caught:
        Repository(tmp_path).entry("m")
    assert str(tmp_path / "m" / "config.yaml") in str(caught.value)
    assert "max_batch_size" in str(caught.value)
    assert "(got -4)" in str(caught.value)
