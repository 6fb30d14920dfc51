"""The runtime the prefill and decode services share: typed settings, the process runtime
(engine loop, gRPC server, shutdown), registration with the router, metrics, and the proto
<-> engine/kvtransfer conversions. The gRPC toolkit it builds on is `pdserve.rpc`."""
