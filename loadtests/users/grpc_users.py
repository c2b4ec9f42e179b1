"""locust user for the v2 gRPC protocol (`inference.GRPCInferenceService/ModelInfer`).

Uses tritonclient's gRPC client (raw_input_contents). gRPC runs its own threads and polling;
`init_gevent()` must run before any channel exists so that they cooperate with locust's gevent
loop, hence it is the first thing this module does. Run through locust's CLI only:

    SLUICE_LOADTEST_MODEL=demo python -m locust -f loadtests/users/grpc_users.py \
        --headless -u 8 -r 8 --run-time 10s --host 127.0.0.1:8001
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import itertools  # noqa: E402  (gRPC must be patched before anything opens a channel)
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any, ClassVar  # noqa: E402

import tritonclient.grpc as triton_grpc  # noqa: E402
from locust import User, constant, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402

from loadtests.failures import BAD_RESPONSE, failure_message  # noqa: E402
from loadtests.locust_summary import install  # noqa: E402
from loadtests.options import UserOptions, add_arguments  # noqa: E402
from loadtests.payloads import PayloadFactory, output_names, resolve_inputs  # noqa: E402

events.init_command_line_parser.add_listener(add_arguments)  # type: ignore[no-untyped-call]
install(events)


class InferFailure(Exception):
    """A failed gRPC call, named the way the report's error breakdown reads it."""


def grpc_target(host: str) -> str:
    """`host:port` from locust's --host, which may carry a grpc:// scheme."""
    for scheme in ("grpc://", "http://"):
        host = host.removeprefix(scheme)
    return host.rstrip("/")


def status_name(exc: triton_grpc.InferenceServerException) -> str:
    """`RESOURCE_EXHAUSTED` from tritonclient's `StatusCode.RESOURCE_EXHAUSTED`."""
    return str(exc.status() or "UNKNOWN").removeprefix("StatusCode.")


class GrpcInferUser(User):
    """Sends ModelInfer with raw input contents; one channel per user."""

    wait_time = constant(0)
    _numbers: ClassVar[Iterator[int]] = itertools.count()

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self.options = UserOptions.from_namespace(environment.parsed_options)
        index = next(self._numbers) + int(getattr(environment.runner, "worker_index", 0) or 0)
        key = self.options.api_key_for(index)
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.request_name = "infer" + self.options.tenant_label(index)
        self.client: triton_grpc.InferenceServerClient | None = None
        self.factory: PayloadFactory | None = None
        self.outputs: list[str] = []

    def on_start(self) -> None:
        self.client = triton_grpc.InferenceServerClient(grpc_target(self.host or ""))
        metadata: Any = self.options.metadata
        if metadata is None:
            metadata = self.client.get_model_metadata(
                self.options.model, self.options.model_version, headers=self.headers, as_json=True
            )
        inputs = resolve_inputs(metadata, self.options.batch_size, self.options.dynamic_size)
        self.outputs = output_names(metadata)
        self.factory = PayloadFactory(inputs, self.options.cache_hit_fraction, self.options.seed)

    def on_stop(self) -> None:
        # An open channel keeps gRPC's threads alive and the process from exiting.
        if self.client is not None:
            self.client.close()
            self.client = None

    @task
    def infer(self) -> None:
        assert self.client is not None
        assert self.factory is not None
        arrays, _ = self.factory.next_arrays()
        tensors = []
        for spec, array in zip(self.factory.inputs, arrays, strict=True):
            tensor = triton_grpc.InferInput(spec.name, list(spec.shape), spec.datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        error: Exception | None = None
        length = 0
        started = time.perf_counter()
        try:
            result = self.client.infer(
                self.options.model,
                tensors,
                model_version=self.options.model_version,
                headers=self.headers,
                client_timeout=self.options.timeout_s,
            )
            response = result.get_response()
            length = sum(len(raw) for raw in response.raw_output_contents)
            missing = set(self.outputs) - {output.name for output in response.outputs}
            if missing:
                error = InferFailure(f"status={BAD_RESPONSE}: outputs {sorted(missing)} missing")
        except triton_grpc.InferenceServerException as exc:
            error = InferFailure(failure_message(status_name(exc), exc.message() or ""))
        self.environment.events.request.fire(
            request_type="grpc",
            name=self.request_name,
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length,
            exception=error,
            context={},
        )
