"""Peers measured in the same run as sluice:

- `plain`: the FastAPI + onnxruntime server people write first (JSON, one request per run);
- `floor`: a no-op ASGI app on uvicorn+httptools returning a fixed v2 response (the HTTP floor).

    taskset -c 0 python -m loadtests.benchmarks.baseline plain|floor REPO PORT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def plain_app(repo: Path) -> FastAPI:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    sessions = {
        folder.name: ort.InferenceSession(str(folder / "1" / "model.onnx"), options)
        for folder in repo.iterdir()
        if (folder / "1" / "model.onnx").exists()
    }
    app = FastAPI()

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: Request) -> JSONResponse:
        payload = await request.json()
        session = sessions[name]
        feed = {
            item["name"]: np.asarray(item["data"], dtype=np.float32).reshape(item["shape"])
            for item in payload["inputs"]
        }
        outputs = session.run(None, feed)
        body: dict[str, Any] = {
            "model_name": name,
            "outputs": [
                {
                    "name": meta.name,
                    "datatype": "FP32",
                    "shape": list(out.shape),
                    "data": out.ravel().tolist(),
                }
                for meta, out in zip(session.get_outputs(), outputs, strict=True)
            ],
        }
        return JSONResponse(body)

    return app


FIXED = (
    b'{"model_name":"mlp","model_version":"1","outputs":[{"name":"probabilities",'
    b'"datatype":"FP32","shape":[1,10],"data":[0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1]}]}'
)


async def floor_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": FIXED})


if __name__ == "__main__":
    kind, repo, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    app: Any = plain_app(repo) if kind == "plain" else floor_app
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http="httptools",
        loop="uvloop",
        log_level="warning",
        access_log=False,
    )
