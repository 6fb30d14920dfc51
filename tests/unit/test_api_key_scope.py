"""The scope each caller gets from the keys it sends (security.client_keys.Scope), and the admin
key's file as the router reads it."""
from __future__ import annotations

import pytest

from pdserve.common.errors import ErrorKind, InvalidRequestError, ServiceError, UnauthenticatedError
from pdserve.router.api_key import client_keys
from pdserve.router.config import ConfigError, RouterConfig
from pdserve.router.frontend import client_error
from pdserve.security.client_keys import ClientKeys, Scope
from pdserve.security.secret import ClusterSecretError


@pytest.mark.parametrize("api_key, admin_key, sent, scope", [
    (None, None, None, Scope.CLIENT),  # no key at all, off loopback: nobody is admin
    (None, None, "Bearer anything", Scope.CLIENT),
    ("k", None, "Bearer k", Scope.CLIENT),
    ("k", None, None, Scope.ANONYMOUS),
    ("k", "a", "Bearer a", Scope.ADMIN),
    ("k", "a", "Bearer k", Scope.CLIENT),
    ("k", "a", "Bearer x", Scope.ANONYMOUS),
    (None, "a", None, Scope.CLIENT),  # an open API with closed internals
    (None, "a", "Bearer a", Scope.ADMIN),
    (None, "a", "Bearer k", Scope.CLIENT),
])
def test_the_key_sent_sets_the_scope(api_key, admin_key, sent, scope) -> None:
    assert ClientKeys(api_key, admin_key).scope(sent) is scope


@pytest.mark.parametrize("host, scope", [("127.0.0.1", Scope.ADMIN), ("::1", Scope.ADMIN),
                                         ("localhost", Scope.ADMIN), ("0.0.0.0", Scope.CLIENT),
                                         ("::", Scope.CLIENT), ("10.0.0.5", Scope.CLIENT)])
def test_a_router_with_no_key_has_an_admin_only_on_loopback(host, scope) -> None:
    """Issue 48, item 7: with no key at all every client was admin. Now only a router that
    listens on loopback (`pdserve up` on a laptop: its callers are this machine's) shows
    everyone everything; listening anywhere else, without an admin key no one is admin,
    over HTTP or gRPC, whatever they send."""
    keys = client_keys(RouterConfig(host=host))
    for sent in (None, "Bearer anything", "Bearer admin"):
        assert keys.scope(sent) is scope
        assert keys.check_metadata([("authorization", sent)] if sent else []) is scope
    admin_file_keys = ClientKeys(None, "a", open_scope=Scope.ADMIN)  # a key set: open_scope is moot
    assert admin_file_keys.scope(None) is Scope.CLIENT and admin_file_keys.scope("Bearer a") is Scope.ADMIN


def test_check_refuses_only_where_an_api_key_is_asked_for() -> None:
    check = ClientKeys("k", "a")
    assert check.check("Bearer a") is Scope.ADMIN and check.check("Bearer k") is Scope.CLIENT
    with pytest.raises(UnauthenticatedError, match="missing"):
        check.check(None)
    with pytest.raises(UnauthenticatedError, match="incorrect"):
        check.check("Bearer nope")
    assert check.check_metadata([("authorization", "Bearer a")]) is Scope.ADMIN
    with pytest.raises(UnauthenticatedError, match="exactly one"):  # which of two would count?
        ClientKeys(None, "a").check_metadata([("authorization", "Bearer k"), ("authorization", "Bearer a")])


def test_the_admin_key_is_read_from_a_private_file(tmp_path) -> None:
    path = tmp_path / "admin"
    path.write_text("s3cret-admin\n")
    path.chmod(0o600)
    check = client_keys(RouterConfig(api_key="k", admin_api_key_file=str(path)))
    assert check.scope("Bearer s3cret-admin") is Scope.ADMIN
    path.chmod(0o644)
    with pytest.raises(ClusterSecretError, match="readable by others"):
        client_keys(RouterConfig(admin_api_key_file=str(path)))
    path.write_text("k")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="differ"):
        client_keys(RouterConfig(api_key="k", admin_api_key_file=str(path)))
    path.write_text("\n")
    with pytest.raises(ConfigError, match="printable"):
        client_keys(RouterConfig(admin_api_key_file=str(path)))


def test_a_client_sees_errors_raised_inside_by_their_kind_only() -> None:
    inside = ServiceError(ErrorKind.UNAVAILABLE, "decode d0 at ipv4:10.0.0.9:50070 unreachable", retry_after_s=1)
    shown = client_error(inside, "chatcmpl-1")
    assert shown.kind is ErrorKind.UNAVAILABLE and shown.retry_after_s == 1
    assert "10.0.0.9" not in shown.message and "d0" not in shown.message
    own = InvalidRequestError("temperature must be in [0, 2]", param="temperature")
    assert client_error(own, "chatcmpl-2").message == "temperature must be in [0, 2]"
    leaky = ServiceError(ErrorKind.INVALID_ARGUMENT, "bad block from [fd00::5]:50100")
    assert client_error(leaky, "chatcmpl-3").message == "bad block from <internal address>"
