# syntax=docker/dockerfile:1.7
# sluice, CPU image: ONNX Runtime (CPU) on Debian slim, non-root, drains on SIGTERM.
#
#   docker build -t sluice:0.1.0 .
#   docker run --rm -p 8000:8000 -p 8001:8001 -v "$PWD/models:/models:ro" \
#       -e SLUICE_AUTH__KEYS='[{"digest": "sha256:<hex>", "tenant": "acme"}]' sluice:0.1.0
#
# The base is pinned to an exact tag; pin it to a digest too for reproducible builds:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest> .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/sluice
WORKDIR /src
COPY requirements/serve.txt requirements/serve.txt
# The locked runtime dependencies first (exact versions, hash-checked, no resolution), in their
# own layer so a code change does not reinstall them; then the sluice wheel alone.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/sluice/bin/pip install --require-hashes --no-deps -r requirements/serve.txt
COPY pyproject.toml README.md ./
COPY server/ server/
COPY engine/ engine/
COPY batching/ batching/
COPY converters/ converters/
COPY loadtests/ loadtests/
# The image carries ONNX Runtime but not torch or the load-test tools (no extras).
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/sluice/bin/pip install --no-deps /src \
    && /opt/sluice/bin/pip uninstall --yes pip setuptools

FROM ${PYTHON_IMAGE} AS runtime
# tini is PID 1: it forwards SIGTERM to the server and reaps strays.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends tini=0.19.0-* \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid sluice --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin sluice \
    && mkdir -p /models /etc/sluice
COPY --from=build /opt/sluice /opt/sluice
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh

# A container must listen beyond loopback; with no API keys configured the server then refuses
# to start (safe default). Give keys (config file or SLUICE_AUTH__KEYS), or opt out explicitly
# with SLUICE_ALLOW_UNAUTHENTICATED=true behind a trusted network boundary.
ENV PATH=/opt/sluice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_HOST=0.0.0.0 \
    SLUICE_HTTP_PORT=8000 \
    SLUICE_GRPC_PORT=8001 \
    SLUICE_MODEL_REPOSITORY=/models \
    SLUICE_LOG_FORMAT=json

# Model repository (<name>/config.yaml, <name>/<version>/model.onnx): mount it read-only.
VOLUME ["/models"]
EXPOSE 8000 8001
USER 10001:10001
WORKDIR /opt/sluice

# Ready, not just live: a loading or draining replica must not count as healthy.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/v2/health/ready' % os.environ.get('SLUICE_HTTP_PORT', '8000'), timeout=2)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/docker-entrypoint.sh"]
CMD []
