"""--insecure-internal says everything it turns off, at every start of every role."""
from __future__ import annotations

import logging

import pytest

from pdserve.rpc.credentials import InternalAuth
from pdserve.security.secret import ClusterSecretError


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_the_warning_names_every_defence_it_turns_off(role, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.auth"):
        auth = InternalAuth.from_settings(role, "0.0.0.0", "", insecure_internal=True)
    assert not auth.enabled
    text = " ".join(r.getMessage() for r in caplog.records)
    for named in ("--insecure-internal", "internal gRPC authentication", "hand-off signatures",
                  "KV transfer challenge", "transfer frames and payloads", "prefix-store records"):
        assert named in text, named


def test_without_it_a_service_beyond_loopback_does_not_start():
    with pytest.raises(ClusterSecretError, match="--insecure-internal"):
        InternalAuth.from_settings("decode", "0.0.0.0", "", insecure_internal=False)
