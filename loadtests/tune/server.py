"""Talking to the server being tuned: read the model's config, load candidates through Triton's
repository API (`load` with a `config` parameter), and put the original back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.runner import LoadTestError
from loadtests.tune.space import config_json


@dataclass(frozen=True, slots=True)
class Original:
    """The config the model served when tuning began, and where it came from."""

    config: dict[str, Any]
    source: str
    """"repository" (its folder's config.yaml) or "load" (a load request's config)."""

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Original:
        return cls(dict(data["config"]), str(data["source"]))


class ServerControl:
    """Reloads one model of a server started with `--model-control-mode explicit`."""

    def __init__(
        self, url: str, model: str, headers: dict[str, str] | None = None, timeout_s: float = 300
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._headers = headers or {}
        self._timeout_s = timeout_s

    def triton_config(self) -> dict[str, Any]:
        """The server's Triton model config of the model."""
        response = self._call("GET", f"/v2/models/{self.model}/config")
        config: dict[str, Any] = response.json()
        return config

    def original(self) -> Original:
        """The sluice config the model serves now (the Triton config's `sluice_config`)."""
        parameters = self.triton_config().get("parameters") or {}
        written = (parameters.get("sluice_config") or {}).get("string_value")
        if written is None:
            raise LoadTestError(
                f"{self.url} does not report model '{self.model}''s sluice config (its model "
                "config has no sluice_config parameter): is it a sluice server?"
            )
        source = (parameters.get("sluice_config_source") or {}).get("string_value", "repository")
        return Original(json.loads(written), source)

    def load(self, config: dict[str, Any]) -> None:
        """Reload the model with `config` (it serves once this returns)."""
        body = {"parameters": {"config": config_json(config)}}
        self._call("POST", f"/v2/repository/models/{self.model}/load", body)

    def restore(self, original: Original) -> None:
        """Serve the original again: a plain load when it was the folder's config.yaml (so
        later edits of that file count again), else a load with its config."""
        if original.source == "repository":
            self._call("POST", f"/v2/repository/models/{self.model}/load", {})
        else:
            self.load(original.config)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        url = self.url + path
        try:
            response = httpx.request(
                method, url, json=body, headers=self._headers, timeout=self._timeout_s
            )
        except httpx.HTTPError as exc:
            raise LoadTestError(f"cannot reach the server at {url}: {exc!r}") from exc
        if response.status_code != 200:
            raise LoadTestError(
                f"{method} {url} answered {response.status_code}: {response.text[:500]}"
            )
        return response
