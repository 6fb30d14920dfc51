"""One contract per direction at the service <-> transfer edge: every implementation of
`SendControl` and `ReceiveControl` has each of its protocol's members under the same name,
of the same kind (a property stays a property), with the same signature: parameter names,
kinds, defaults and annotations, and the return annotation. A drifted method (a parameter
added on one side only, a default changed) fails here, not in a service at run time."""
from __future__ import annotations

import inspect

import pytest

from pdserve.kvtransfer.connector.receives import DecodeReceives
from pdserve.kvtransfer.connector.send_control import ServiceSends
from pdserve.kvtransfer.ports import NoReceives, ReceiveControl, SendControl
from pdserve.worker.transfer import AdvertisedReceives

IMPLEMENTATIONS = [(SendControl, ServiceSends), (ReceiveControl, DecodeReceives),
                   (ReceiveControl, AdvertisedReceives), (ReceiveControl, NoReceives)]


def members(protocol: type) -> dict[str, object]:
    """The protocol's own members: its methods and properties."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}


def signature_of(member: object) -> inspect.Signature:
    return inspect.signature(member.fget if isinstance(member, property) else member)


def test_each_protocol_names_what_its_services_call():
    assert sorted(members(SendControl)) == ["abort_send", "connect_ahead", "unusable", "wait_verdict"]
    assert sorted(members(ReceiveControl)) == ["cancel_receive", "complete_receive", "endpoints", "prepare_receive"]


@pytest.mark.parametrize("protocol, implementation", IMPLEMENTATIONS,
                         ids=[f"{p.__name__}-{i.__name__}" for p, i in IMPLEMENTATIONS])
def test_an_implementation_matches_its_protocol_member_by_member(protocol, implementation):
    for name, wanted in members(protocol).items():
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        got = inspect.getattr_static(implementation, name)
        assert isinstance(got, property) == isinstance(wanted, property), f"{implementation.__name__}.{name}: kind"
        assert signature_of(got) == signature_of(wanted), (
            f"{implementation.__name__}.{name}{signature_of(got)} != {protocol.__name__}.{name}{signature_of(wanted)}")


def test_a_drifted_signature_is_caught():
    """The check itself: a parameter missing on one side is a mismatch (the drift this test
    exists for: a `prepare_receive` without `block_hashes`)."""
    def prepare_receive(self, request_id, block_ids, num_prompt_tokens, num_leading_blocks, deadline,
                        transfer_id=None):
        pass

    assert inspect.signature(prepare_receive) != signature_of(members(ReceiveControl)["prepare_receive"])


def test_the_connector_gives_the_services_its_rooms(tmp_path):
    """`PdConnector.sends` and `.receives` are the implementations held to the protocols above."""
    from kvcaches import tiny_layout
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.kvtransfer.connector import build_connector

    layout = tiny_layout()
    connector = build_connector(KVTransferConfig(backends=("disk", "recompute"), disk_store=str(tmp_path)),
                                layout, listen=False)
    try:
        assert isinstance(connector.sends, ServiceSends) and isinstance(connector.receives, DecodeReceives)
        assert connector.sends.book is connector.worker.sends.book  # one book, two rooms
    finally:
        connector.worker.close()
