"""The security wing: one module per trust boundary, each opening with the threat it answers
and the rule it keeps. Torch-free and grpc-free; interceptors, transports and stores are
adapters that ask these modules. Depends only on `common` and `cryptography`."""
