"""The security wing: one module per trust boundary, each opening with the threat it answers
and the rule it keeps. Torch-free and grpc-free; interceptors, transports and stores are
adapters that ask these modules. Depends only on `common` and `cryptography`.

* `secret`         the cluster secret, secret files, and every key derived from it
* `credentials`    call keys and the credentials of internal calls (who may call what)
* `key_directory`  a worker's directory of the keys that verify its callers
* `internal_tls`   internal certificates: the addresses a host certificate binds
* `handoffs`       the decode's signed order to a prefill, accepted once
* `registration`   a worker's claim on an id in a router's registry: lease and key
* `store_records`  the AEAD that seals (encrypts and tags) a Redis/disk KV record
* `client_keys`    the API and admin keys, and what each caller may see
* `tenants`        the tenants' keys file, their cache namespaces and limits
* `enrollment`     a worker's own enrollment token: who may join, revocation
* `enroller`       which pod of a Kubernetes release gets which token (the chart's enroller)
* `slow_clients`   an HTTP port's header deadline and connection bound

The transfer session (`transfer_session`) and the gloo listener filters
(`socket_admission`) are the point-to-point transports' boundaries."""
