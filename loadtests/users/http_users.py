"""locust users for the v2 HTTP/REST protocol: JSON tensors and the binary tensor extension.

Run through locust's CLI only (`sluice loadtest` does), never imported by the harness: importing
locust monkey-patches the process with gevent. By hand:

    SLUICE_LOADTEST_MODEL=demo python -m locust -f loadtests/users/http_users.py \
        --headless -u 8 -r 8 --run-time 10s --host http://127.0.0.1:8000 JsonInferUser

Every user is a closed loop (no think time): the user count is the number of requests in flight.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import orjson
from locust import FastHttpUser, constant, events, task
from locust.env import Environment

from loadtests.failures import BAD_RESPONSE, error_detail, failure_message
from loadtests.locust_summary import install
from loadtests.options import UserOptions, add_arguments
from loadtests.payloads import (
    PayloadFactory,
    binary_body,
    json_body,
    output_names,
    resolve_inputs,
)

events.init_command_line_parser.add_listener(add_arguments)  # type: ignore[no-untyped-call]
install(events)


class _InferUser(FastHttpUser):
    """Shared set-up: options, metadata, inputs, API key and request name."""

    abstract = True
    wait_time = constant(0)
    _numbers: ClassVar[Iterator[int]] = itertools.count()

    def __init__(self, environment: Environment) -> None:
        self.options = UserOptions.from_namespace(environment.parsed_options)
        # Read by FastHttpUser.__init__ when it builds the client.
        self.network_timeout = self.options.timeout_s
        self.connection_timeout = self.options.timeout_s
        super().__init__(environment)
        index = next(self._numbers) + int(getattr(environment.runner, "worker_index", 0) or 0)
        key = self.options.api_key_for(index)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.request_name = "infer" + self.options.tenant_label(index)
        model = self.options.model
        version = self.options.model_version
        self.model_path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        self.factory: PayloadFactory | None = None
        self.outputs: list[str] = []

    def on_start(self) -> None:
        metadata = self.options.metadata
        if metadata is None:
            # Run by hand without --sluice-metadata: ask the server (shows as a `metadata` row).
            response = self.client.get(self.model_path, headers=self.headers, name="metadata")
            if response.status_code != 200:
                raise RuntimeError(
                    f"metadata of '{self.options.model}' answered {response.status_code}"
                )
            metadata = orjson.loads(response.content)
        inputs = resolve_inputs(metadata, self.options.batch_size, self.options.dynamic_size)
        self.outputs = output_names(metadata)
        self.factory = PayloadFactory(inputs, self.options.cache_hit_fraction, self.options.seed)

    def _check(self, response: Any, header_length: int | None) -> None:
        """Mark the response failed unless it is a 200 carrying every requested output."""
        if response.status_code == 0:
            return  # no response at all: locust already recorded the connection error
        if response.status_code != 200:
            response.failure(
                failure_message(response.status_code, error_detail(response.content or b""))
            )
            return
        body = response.content or b""
        try:
            head = orjson.loads(body[:header_length] if header_length is not None else body)
            names = {output["name"] for output in head["outputs"]}
        except (orjson.JSONDecodeError, KeyError, TypeError):
            response.failure(f"status={BAD_RESPONSE}: undecodable body")
            return
        missing = set(self.outputs) - names
        if missing:
            response.failure(f"status={BAD_RESPONSE}: outputs {sorted(missing)} missing")


class JsonInferUser(_InferUser):
    """Sends v2 JSON requests (`data` lists) and reads JSON answers."""

    @task
    def infer(self) -> None:
        assert self.factory is not None
        arrays, _ = self.factory.next_arrays()
        body = json_body(self.factory.inputs, arrays, self.outputs)
        headers = {**self.headers, "Content-Type": "application/json"}
        with self.client.post(
            self.model_path + "/infer",
            data=body,  # type: ignore[arg-type]  # bytes are sent as they are
            headers=headers,
            name=self.request_name,
            catch_response=True,
        ) as response:
            self._check(response, None)


class BinaryInferUser(_InferUser):
    """Sends the binary tensor extension and asks for binary outputs."""

    @task
    def infer(self) -> None:
        assert self.factory is not None
        arrays, _ = self.factory.next_arrays()
        body, header_length = binary_body(self.factory.inputs, arrays, self.outputs)
        headers = {
            **self.headers,
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_length),
        }
        with self.client.post(
            self.model_path + "/infer",
            data=body,  # type: ignore[arg-type]  # bytes are sent as they are
            headers=headers,
            name=self.request_name,
            catch_response=True,
        ) as response:
            length = response.headers.get("Inference-Header-Content-Length")
            self._check(response, int(length) if length else None)
