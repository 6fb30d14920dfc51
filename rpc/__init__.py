"""The gRPC toolkit every pdserve process shares (router and workers alike).

    credentials.py  internal call credentials: the client interceptors, the server's
                    AuthInterceptor, mutual TLS between services, InternalAuth
    server.py       server set-up: message limits, health and reflection, malformed requests
    errors.py       the error table spoken over gRPC: a servicer decorator and its reverse
    channels.py     channels to other services, one per address, reused

Depends only on `pdserve.common` and `pdserve.proto`.
"""
