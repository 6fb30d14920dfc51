"""The connector's room for the prefill service's side of its sends (`SendControl`): called
on any service thread, never the engine's. The engine's side of the same sends is
`EngineSends`; the two share only the `SendBook` and the `Connections`."""
from __future__ import annotations

from pdserve.kvtransfer.chain import FallbackChain
from pdserve.kvtransfer.connector.connections import Connections
from pdserve.kvtransfer.connector.send_book import SendBook
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.verdict import Fallback, Landing, TransferVerdict


class ServiceSends:
    def __init__(self, book: SendBook, chain: FallbackChain, connections: Connections) -> None:
        self.book = book
        self.chain = chain
        self.connections = connections

    def connect_ahead(self, params: TransferParams) -> None:
        """`SendControl.connect_ahead`: warm the links to a receiver's transports in the
        background (once per endpoint), overlapping the connection with the prefill."""
        self.connections.connect_ahead(params)

    def unusable(self, params: TransferParams) -> list[Fallback]:
        return self.chain.unusable(dict(params.endpoints), params.backends)

    def wait_verdict(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """`SendControl.wait_verdict`: the verdict of a send, taken from the board."""
        return self.book.verdicts.wait(request_id, timeout_s)

    def abort_send(self, request_id: str) -> bool:
        """The request is being aborted. A send that has not started never will (its verdict
        says aborted); one under way runs to its own deadline. True if a pending send was
        dropped."""
        spec = self.book.drop(request_id)
        if spec is None:
            return False
        self.book.post(request_id, TransferVerdict(spec.params.transfer_id.hex(), Landing.ABORTED, ""))
        return True
