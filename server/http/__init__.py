"""The HTTP/REST front-end: the Open Inference Protocol (KServe v2) with Triton's extensions and
the OpenAI-compatible API, on uvicorn. `app.create_app` builds the ASGI app; inference is served
by `infer_route` in front of FastAPI, over the shared data plane (server/dataplane.py)."""
