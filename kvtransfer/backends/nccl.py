"""`nccl`: point-to-point KV transfer over torch.distributed, one process group per link
(sender rank 0, receiver rank 1): NCCL between CUDA devices, gloo on CPU; the link protocol of
`_link` with a process group as its payload channel.

Pairing: the hello names the backend; once welcomed, both sides build the two-rank group whose
store is the control connection itself (`_rendezvous.PairStore`: keys travel as sealed frames,
no store server), move PROBE_BYTES over it (NCCL connects on its first payload) and close the
rendezvous. The group is constructed directly, so torch.distributed's default group is never
initialised and any number of pairs coexist in one process. A gloo device's listener, which
authenticates nobody, is filtered in the kernel (`security.socket_admission`); NCCL's unique
id travels only on the control connection (NCCL's proxy and socket listeners are its own).

On NCCL a keyless link's payload goes device to device: the sender gathers the blocks into a
GPU tensor (`device_direct`) and the receiver lands it in a GPU staging tensor
(`staging(header, on_device=True)`). A keyed link's payload is sealed and opened on the host
(`security.transfer_session`), in chunks posted as separate sends and receives (`_payload`):
only ciphertext crosses NCCL. A gloo wait cannot be
interrupted and a gloo timeout breaks the pair, so a receive is posted only when a payload is
announced, bounded by that message's budget.
"""
from __future__ import annotations

import datetime
import logging
import socket
import time

from pdserve.common import envs
from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _p2p
from pdserve.kvtransfer.backends._channel import Carrier, Channel, Control, Landing, Receive, Sending
from pdserve.kvtransfer.backends._link import P2PTransport

log = logging.getLogger(__name__)

HELLO_VERSION = 5  # the hello's transport version (4: paired by nccl's own hello; 3: a TCPStore)
BACKENDS = ("gloo", "nccl")
MAX_SEQ = 0x7FFFFFFF  # tags of torch.distributed send/recv are signed ints
FIRST_TAG = MAX_SEQ  # the pairing's first bytes; requests count from 0 after them


def default_backend() -> str:
    """PDSERVE_NCCL_BACKEND, or for auto: nccl where CUDA is available, else gloo."""
    name = envs.get("PDSERVE_NCCL_BACKEND").strip().lower()
    if name == "auto":
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    if name not in BACKENDS:
        raise ValueError(f"PDSERVE_NCCL_BACKEND={name!r}: choose gloo, nccl or auto")
    return name


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


# -- process groups -------------------------------------------------------------------------------
def _new_group(backend: str, store, rank: int, local_host: str, timeout_s: float):
    """A two-rank group of its own on `store` (the default group is never touched); blocks
    until both ranks joined or `timeout_s` passed. gloo listens on `local_host` (the address
    the control connection uses on this side, so the peer can reach it)."""
    import torch.distributed as dist

    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._threads = 1
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if not dist.is_nccl_available():
        raise TransferError("this torch build has no NCCL (use the gloo backend)")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _timedelta(timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _pair_group(backend: str, sock: socket.socket, session: _p2p.Session, rank: int, deadline: float):
    """The pair's group, met through the control connection (`_rendezvous.PairStore`): built,
    its first PROBE_BYTES moved from rank 0 to rank 1 (NCCL builds its communicator on the
    first payload, while the store is still open), then the rendezvous closed. Both sides call
    this right after the accepting hello reply; on return the connection carries requests.
    On gloo, the device's listener admits only the peer's host until then, nobody after
    (`security.socket_admission`)."""
    import torch

    from pdserve.kvtransfer.backends import _rendezvous
    from pdserve.security import socket_admission

    peer_host = sock.getpeername()[0]
    guard = (lambda value: socket_admission.admit_only([value], peer_host)) if backend == "gloo" else (lambda value: 0)
    store = _rendezvous.PairStore(sock, session, deadline, before_publish=guard)
    group = _new_group(backend, store, rank, sock.getsockname()[0], deadline - time.monotonic())
    if rank == 0:
        tensor = _payload_tensor(bytes(_p2p.PROBE_BYTES), backend)
        _settle(group.send([tensor], 1, FIRST_TAG), tensor, deadline)
    else:
        tensor = torch.empty(_p2p.PROBE_BYTES, dtype=torch.uint8, device="cuda" if backend == "nccl" else "cpu")
        _settle(group.recv([tensor], 0, FIRST_TAG), tensor, deadline)
    store.finish(deadline)
    if backend == "gloo":  # connected: gloo's listener admits nobody from now on
        socket_admission.admit_none(store.published)
    return group


def _payload_tensor(payload: object, backend: str):
    """The message payload as a flat uint8 tensor on the backend's device."""
    import torch

    if hasattr(payload, "element_size"):
        tensor = payload.detach().contiguous().reshape(-1).view(torch.uint8)
    else:
        view = memoryview(payload)
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        # torch wants a writable buffer; a read-only one (bytes) is copied once
        tensor = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    if backend == "nccl" and not tensor.is_cuda:
        tensor = tensor.cuda()
    elif backend == "gloo" and tensor.is_cuda:
        tensor = tensor.cpu()
    return tensor


def _staging_tensor(staging: object):
    """The sink's staging buffer as a flat writable uint8 tensor (shares its memory)."""
    import torch

    if hasattr(staging, "element_size"):
        if not staging.is_contiguous():
            raise TransferError("the staging tensor is not contiguous")
        return staging.detach().reshape(-1).view(torch.uint8)
    view = memoryview(staging)
    if view.readonly:
        raise TransferError("the staging buffer is read-only")
    return torch.frombuffer(view.cast("B") if view.format != "B" else view, dtype=torch.uint8)


def _settle(work, tensor, deadline: float) -> None:
    """Wait for a send/recv until `deadline`; on CUDA also until its stream is done with
    `tensor` (a NCCL wait may only order streams)."""
    work.wait(_timedelta(deadline - time.monotonic()))
    if tensor.is_cuda:
        import torch

        torch.cuda.current_stream(tensor.device).synchronize()


# -- the channel ---------------------------------------------------------------------------------
class _GroupReceive(Receive):
    def __init__(self, work, landing) -> None:
        self.work, self.landing = work, landing

    def wait(self, deadline: float, control) -> bool:
        """A gloo wait cannot be interrupted: the hang-up is seen after it (the budget bounds it)."""
        try:
            _settle(self.work, self.landing, deadline)
        except RuntimeError as exc:  # a gloo timeout or error breaks the pair
            log.warning("nccl receiver: the payload did not arrive: %s", exc)
            return False
        return True


class _GroupSending(Sending):
    """A send posted on the group; its tensor is held until it is settled or the link dropped."""

    def __init__(self, work, tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, deadline: float) -> None:
        try:
            _settle(self.work, self.tensor, deadline)
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"payload not taken before the deadline: {exc}") from None
            raise TransferError(f"payload send failed: {exc}") from exc


class _GroupChannel(Channel):
    """A two-rank process group; payloads tagged with the request's seq."""

    max_seq = MAX_SEQ

    def __init__(self, group, backend: str, rank: int) -> None:
        self.group, self.backend, self.peer = group, backend, 1 - rank

    def outgoing(self, payload: object) -> object:
        return _payload_tensor(payload, self.backend)

    def send(self, data: object, seq: int, deadline: float) -> None:
        self.start_send(data, seq, deadline).wait(deadline)

    def start_send(self, data: object, seq: int, deadline: float) -> Sending:
        try:
            return _GroupSending(self.group.send([data], self.peer, seq), data)
        except RuntimeError as exc:
            raise TransferError(f"payload send failed: {exc}") from exc

    def landing(self, sink, header) -> Landing:
        on_device = self.backend == "nccl"
        staging = sink.staging(header, on_device=True) if on_device else sink.staging(header)
        target = _staging_tensor(staging)
        if target.numel() != header.payload_len:
            raise TransferError(f"staging is {target.numel()} bytes, payload {header.payload_len}")
        if not on_device or target.is_cuda:
            return Landing(staging, target)
        landing = target.cuda()  # a sink that stages in host memory
        return Landing(staging, landing, finish=lambda: target.copy_(landing))

    def probe_landing(self, nbytes: int) -> object:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device="cuda" if self.backend == "nccl" else "cpu")

    def post_receive(self, buffer: object, seq: int) -> Receive:
        return _GroupReceive(self.group.recv([buffer], self.peer, seq), buffer)

    def abort(self) -> None:
        """The group's connections close with the object, which ends any wait the peer has on it."""
        self.group = None


class _GroupCarrier(Carrier):
    name = "nccl"

    def __init__(self, backend: str) -> None:
        self.backend = backend

    @property
    def version(self) -> int:
        return HELLO_VERSION

    def hello(self) -> bytes:
        return self.backend.encode()

    def welcome(self, hello: bytes) -> bytes:
        if hello != self.backend.encode():
            raise TransferError(f"backend mismatch: sender {hello.decode('ascii', 'replace')}, "
                                f"receiver {self.backend}")
        return b""

    def open(self, control: Control, hello: bytes, welcome: bytes, deadline: float) -> Channel:
        rank = 0 if control.is_sender else 1
        return _GroupChannel(_pair_group(self.backend, control.sock, control.session, rank, deadline),
                             self.backend, rank)


class NcclTransport(P2PTransport):
    """KV blocks over a per-pair torch.distributed group. `backend`: gloo, nccl, or None for
    PDSERVE_NCCL_BACKEND."""

    name = "nccl"
    connects_ahead = False  # a pair is made by its first send

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str | None = None,
                 key: bytes | None = None) -> None:
        super().__init__(host, port, key)
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        import torch.distributed as dist

        if not (dist.is_gloo_available() if self.backend == "gloo" else dist.is_nccl_available()):
            raise TransferError(f"this torch build has no {self.backend} process groups")

    @property
    def device_direct(self) -> bool:
        """On NCCL without a transfer key, GPU payloads go device to device: senders should keep
        them there (keyed, they are sealed on the host)."""
        return self.backend == "nccl" and self.key is None

    def new_carrier(self) -> Carrier:
        return _GroupCarrier(self.backend)


def create_transport(config) -> NcclTransport:
    """Registry factory. Listens on `config.host`; with a fixed `config.transfer_port` the
    nccl receiver takes the next port (ucx takes the port itself)."""
    port = config.transfer_port + 1 if config.transfer_port else 0
    return NcclTransport(host=config.host, port=port, key=config.transfer_key)
