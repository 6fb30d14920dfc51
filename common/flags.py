"""Settings declared with their flags: one dataclass field per setting is the one place a
setting is written. The CLI builds its flags from these fields, YAML keys and `PDSERVE_*`
variables follow the flags, and `pdserve up` passes on whole groups of them.

    model: str = setting("default", "the model to serve", "engine")
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

# help shared by every process's security flags (workers and the router declare them alike)
SECURITY_HELP = {
    "cluster_secret_file": "file holding this deployment's secret (mode 0600, the same on every service); "
                           "every internal call is authenticated with it",
    "internal_tls_cert": "PEM certificate for mutual TLS on internal gRPC, with --internal-tls-key and "
                         "--internal-tls-ca: the deployment's (SAN 'pdserve-internal') or this host's (SANs: its "
                         "IP addresses; peers are then checked by address)",
    "internal_tls_key": "PEM private key of --internal-tls-cert",
    "internal_tls_ca": "PEM CA that every internal peer's certificate must chain to",
    "insecure_internal": "allow binding beyond loopback without a cluster secret; this turns off internal gRPC "
                         "authentication, hand-off signatures, the KV transfer challenge and its MACs, and "
                         "the prefix store's record MACs (a warning naming them at every start)",
}


def setting(default: Any, help: str, group: str, *, choices: tuple = (), roles: tuple = ("prefill", "decode"),
            default_factory: Any = None, repeated: bool = False) -> Any:
    """A dataclass field that is also a flag: `help` (its default is appended), the `group`
    it is listed in, `choices`, and the `roles` that take it (workers: prefill, decode). A
    `repeated` flag takes one or more values and may be given again (its default is ())."""
    metadata = {"help": help, "group": group, "choices": choices, "roles": roles, "repeated": repeated}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def security(name: str, default: Any, roles: tuple = ("prefill", "decode")) -> Any:
    return setting(default, SECURITY_HELP[name], "common", roles=roles)
