"""The gRPC front-end: `inference.GRPCInferenceService` (Open Inference Protocol plus Triton's
extensions) on grpc.aio. `service.build_grpc_server` builds the server; the protocol's
generated modules are in `proto/`; every call goes through the shared data plane
(server/dataplane.py)."""
