"""Tenants' keys (security.tenants), their callers (security.client_keys) and their limits
(router.tenant_limits): a keys file read again when it changes, a bad one refused while the
last good table stays, each tenant its own cache namespace, 429s with Retry-After."""
from __future__ import annotations

import os

import pytest

from pdserve.common.errors import OverloadedError, UnauthenticatedError
from pdserve.router.tenant_limits import TenantLimiter
from pdserve.security.client_keys import ClientKeys, Scope
from pdserve.security.tenants import Tenant, TenantKeys, TenantKeysError, TenantLimits, tenant_cache_salt


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _write(path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)
    stamp = os.stat(path).st_mtime_ns + 1_000_000_000 * (1 + hash(text) % 7)  # a change the stat sees
    os.utime(path, ns=(stamp, stamp))


def test_keys_file_names_tenants_and_is_read_again_when_it_changes(tmp_path) -> None:
    path, clock = tmp_path / "keys", Clock()
    _write(path, "# tenants\nacme  key-a  requests_per_minute=5\n\nglobex key-g # trailing comment\n")
    keys = TenantKeys(path, recheck_s=1.0, clock=clock)
    assert keys.lookup("key-a") == Tenant("acme", TenantLimits(requests_per_minute=5))
    assert keys.lookup("key-g").name == "globex" and keys.lookup("key-x") is None
    _write(path, "acme key-a2\n")
    assert keys.lookup("key-a") is not None  # not rechecked within recheck_s
    clock.now += 1.5
    assert keys.lookup("key-a") is None and keys.lookup("key-a2").name == "acme"
    _write(path, "acme\n")  # broken: the last good table stays
    clock.now += 1.5
    assert keys.lookup("key-a2").name == "acme"


@pytest.mark.parametrize("text", ["acme\n", "a/b key\n", "acme key speed=3\n", "a k1\nb k1\n"])
def test_a_bad_keys_file_is_refused_at_start(tmp_path, text: str) -> None:
    path = tmp_path / "keys"
    _write(path, text)
    with pytest.raises(TenantKeysError):
        TenantKeys(path)


def test_a_keys_file_others_can_read_is_refused(tmp_path) -> None:
    path = tmp_path / "keys"
    _write(path, "acme key-a\n")
    path.chmod(0o644)
    with pytest.raises(Exception, match="readable by others"):
        TenantKeys(path)


def test_a_tenant_key_names_its_caller_and_others_are_refused(tmp_path) -> None:
    path = tmp_path / "keys"
    _write(path, "acme key-a\n")
    keys = ClientKeys(None, "admin-key", TenantKeys(path))
    assert keys.identify("Bearer key-a").tenant.name == "acme"
    assert keys.identify("Bearer admin-key").scope is Scope.ADMIN
    assert keys.identify_metadata([("authorization", "Bearer key-a")]).scope is Scope.CLIENT
    for sent in (None, "Bearer key-b", "key-a", "Bearer key-ab"):
        with pytest.raises(UnauthenticatedError):
            keys.identify(sent)
    shared = ClientKeys("shared", None, TenantKeys(path))
    assert shared.identify("Bearer shared").tenant is None  # the one API key: no tenant


def test_each_tenant_hashes_in_its_own_namespace() -> None:
    assert tenant_cache_salt("acme", "") != tenant_cache_salt("globex", "")
    assert tenant_cache_salt("acme", "") != tenant_cache_salt("acme", "finer")
    assert tenant_cache_salt("a", "b:c") != tenant_cache_salt("a:b", "c")
    assert len(tenant_cache_salt("x" * 64, "y" * 256)) <= 256


def test_requests_per_minute_and_in_flight_answer_429_with_retry_after() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    tenant = Tenant("acme", TenantLimits(requests_per_minute=2, in_flight=1))
    with limiter.hold(tenant):
        with pytest.raises(OverloadedError) as busy:
            with limiter.hold(tenant):
                pass
        assert busy.value.retry_after_s == 1
    with limiter.hold(tenant):
        pass
    with pytest.raises(OverloadedError) as spent:
        with limiter.hold(tenant):
            pass
    assert spent.value.retry_after_s == 30  # one request back every 30 s
    with limiter.hold(Tenant("globex", TenantLimits(requests_per_minute=2))):
        pass  # another tenant's minute is its own
    clock.now += 30
    with limiter.hold(tenant):
        pass


def test_tokens_per_minute_are_charged_and_refill() -> None:
    clock = Clock()
    limiter = TenantLimiter(clock)
    tenant = Tenant("acme", TenantLimits(tokens_per_minute=600))
    limiter.charge_tokens(tenant, 500)
    with pytest.raises(OverloadedError) as spent:
        limiter.charge_tokens(tenant, 200)
    assert spent.value.retry_after_s == 10  # 100 tokens at 10 per second
    clock.now += 10
    limiter.charge_tokens(tenant, 200)
    with pytest.raises(OverloadedError):
        limiter.charge_tokens(tenant, 601)
    limiter.charge_tokens(None, 10**9)  # no tenant: no limit
