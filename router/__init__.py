"""The router: OpenAI HTTP + gRPC front, routing policies, worker registry, health.

A request's way: `http_api` / `grpc_api` (edges) -> `frontend` (admission, `prompt`,
`validation`, `planner` with `policies` over the `registry`) -> `dispatch` (Decode stream on
the chosen worker) -> back through `openai_format` or as GenerateResponses. `membership`
handles Register/Heartbeat/Deregister, `catalog` the served models, `metrics` Prometheus,
`app` wires it all into one asyncio process, `main` is `pdserve router`. Never imports torch.
"""
