"""The runtime the prefill and decode services share: typed settings, the process runtime
(engine loop, gRPC server with health and reflection, shutdown), registration with the
router, gRPC error mapping, metrics, and proto <-> engine conversions. The router uses its
gRPC glue (`serving`, `grpc_errors`) too, and nothing else of it."""
