"""The engine's interface as the front-ends see it.

`EngineFacade` lists exactly what server/ uses of `engine.engine.Engine`: the data plane and
the process lifecycle type against it, so the engine behind them may be the one in this process
(`Engine`) or a proxy to an engine process (`--workers N`). Members are added, never renamed.

Whatever the engine process may be slow to answer is a coroutine (metadata, config, statistics,
the repository index, an input check not yet fetched, the metrics exposition): a worker awaits
its answer, so its event loop serves its other requests meanwhile.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.auth import Authenticator
    from engine.generation.service import Generation
    from engine.metrics import Metrics
    from engine.regions import SystemRegions
    from engine.tracing import Tracing
    from engine.types import InferRequest, InferResponse, ModelMetadata
    from engine.validate import InputCheck


class EngineFacade(Protocol):
    """What a front-end may call on the engine (see `engine.engine.Engine` for the behaviour)."""

    @property
    def authenticator(self) -> Authenticator:
        """API keys -> principals (tenant, roles, models); `reload_file` swaps the keys file's."""

    @property
    def regions(self) -> SystemRegions:
        """The shared-memory regions clients registered in this process (engine/regions.py)."""

    @property
    def metrics(self) -> Metrics:
        """The engine's Prometheus metrics: front-ends count requests and encode times there,
        and await its exposition (a worker's is the engine process's, asked of it)."""

    @property
    def tracing(self) -> Tracing | None:
        """The engine's OpenTelemetry spans, or None when tracing is off."""

    @property
    def generation(self) -> Generation | None:
        """Who serves generation: this process's GenerationService, a worker's relay to the
        engine process's, or None where the engine serves none (the generation routes are then
        not mounted)."""

    @property
    def live(self) -> bool:
        """The process is up (liveness)."""

    @property
    def draining(self) -> bool:
        """A drain has begun: new requests are refused with ShuttingDown."""

    async def ready_now(self) -> bool:
        """Started, not draining, and (with strict readiness) every model asked for serves, as
        the engine holds it at this moment: what readiness probes answer."""

    async def start(self) -> None:
        """Scan the repository and load what the model control mode says."""

    def stop_accepting(self) -> None:
        """First step of a drain: readiness turns 503 and new requests are refused."""

    async def drain(self) -> None:
        """Finish every accepted request, bounded by `drain_timeout_s`."""

    async def close(self) -> None:
        """Close models, the cache, the limiter and tracing."""

    async def infer(self, request: InferRequest) -> InferResponse:
        """Answer one inference request, or raise an EngineError saying why not."""

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck | None:
        """`input_check`'s answer when it is at hand without waiting (always in the engine's own
        process; in a worker, once fetched for the loaded models' generation), else None:
        inference asks this first, so a request costs no await for its check."""

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        """The check of declared shapes and datatypes run before any tensor is decoded (the
        data plane passes what it found to `infer`: InferRequest.checked)."""

    def server_metadata(self) -> dict[str, Any]:
        """The server's name, version and protocol extensions."""

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        """A model version's name, versions, platform and tensors (ModelNotFound if none)."""

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether that model version serves now."""

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The effective model configuration in Triton's JSON shape."""

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        """Triton statistics ({"model_stats": [...]}) of every, one model's, or one version."""

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository's models: name, version, state and reason."""

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        """Load or reload a model by API (explicit and poll modes); Triton's `config` parameter
        carries a JSON model config that replaces the folder's config.yaml."""

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        """Unload a model by API (explicit and poll modes)."""

    async def usage(self, tenant: str) -> dict[str, Any]:
        """The tenant's quotas, buckets and slots now (`GET /v2/tenants/self/usage`)."""

    def label_for(self, name: str) -> str:
        """`name` if such a model is loaded, else a fixed label (clients cannot grow metrics)."""
