"""Socket admission: keeping strangers off the TCP listener of a pair's gloo device (`nccl` on CPU).

Threat: a gloo device listens on an ephemeral port for as long as its group lives, accepts
anyone, and keeps every connection it accepted (the pair's peer names itself with 8 bytes;
gloo has no authentication): any process that reaches the port could hold descriptors and
memory of a decode forever, or take the pair's place while it connects.

Rule: each side of a pair narrows its device's listener with a classic BPF socket filter,
which the kernel runs on every packet that reaches the listener, the SYNs included: while the
pair connects, only packets from the peer's host pass (`admit_only`); once the pair is
connected, none (`admit_none`), so a later connect never completes and gloo never accepts it.
The connection the pair already made keeps the filter it was accepted under (the peer's host
only). What is left: during that window a process on the peer's host could take the pair's
place; the bytes it sent instead of the peer's fail the payload MAC (`transfer_session`).

The listener is found by its address: the bytes gloo publishes in the rendezvous hold its
`sockaddr`, and among this process's listening sockets exactly one is bound there while the
group lives. Linux only; elsewhere, or when the filter cannot be attached, the listener stays
open and a warning says so.
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
import sys
from typing import Iterable

log = logging.getLogger(__name__)

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux's value
SKF_NET_OFF = -0x100000  # a load at this offset reads the network (IP) header
# classic BPF opcodes
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0
IPV4_SOURCE, IPV6_SOURCE = 12, 8  # offsets of the source address in each IP header

Instruction = tuple[int, int, int, int]  # code, jump if true, jump if false, constant


def _source_is(host: str) -> list[Instruction] | None:
    """A program that accepts packets from `host` only; None for an address it cannot match
    (an IPv4-mapped IPv6 peer arrives with an IPv4 header)."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return None
    words = [int.from_bytes(address.packed[i:i + 4], "big") for i in range(0, len(address.packed), 4)]
    first = IPV4_SOURCE if address.version == 4 else IPV6_SOURCE
    program: list[Instruction] = []
    for i, word in enumerate(words):  # every mismatch jumps to the final DROP
        to_drop = 2 * (len(words) - i) - 1
        program += [(LD_W_ABS, 0, 0, (SKF_NET_OFF + first + 4 * i) & 0xFFFFFFFF), (JEQ_K, 0, to_drop, word)]
    return program + [(RET_K, 0, 0, ACCEPT), (RET_K, 0, 0, DROP)]


def _attach(sock: socket.socket, program: list[Instruction]) -> None:
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in program))  # sock_filter[]
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("=HxxxxxxQ", len(program),
                                                                     ctypes.addressof(code)))


def _sockaddr(family: int, host: bytes, port: int) -> tuple[bytes, int, bytes]:
    """How a kernel `sockaddr_in`/`sockaddr_in6` for (host, port) starts, where its address
    sits, and the address: what gloo copies into the address it publishes."""
    head = struct.pack("=H", family) + struct.pack("!H", port)
    return head, len(head) + (0 if family == socket.AF_INET else 4), host  # sin6_flowinfo first


def _is_published(published: list[bytes], family: int, host: bytes, port: int) -> bool:
    head, at, host = _sockaddr(family, host, port)
    for value in published:
        start = value.find(head)
        while start >= 0:
            if value[start + at:start + at + len(host)] == host:
                return True
            start = value.find(head, start + 1)
    return False


def _listening_inodes(published: list[bytes]) -> set[str]:
    """Inodes of the listening TCP sockets (this network namespace) whose address appears in
    `published`. /proc/net/tcp* print each 32-bit word of an address in host byte order."""
    inodes = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:  # no IPv6 here
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            host_hex, port_hex = cols[1].split(":")
            host = b"".join(bytes.fromhex(host_hex[i:i + 8])[::-1] if sys.byteorder == "little"
                            else bytes.fromhex(host_hex[i:i + 8]) for i in range(0, len(host_hex), 8))
            if _is_published(published, family, host, int(port_hex, 16)):
                inodes.add(cols[9])
    return inodes


def own_listeners(published: Iterable[bytes]) -> list[socket.socket]:
    """Duplicates of this process's listening TCP sockets whose address appears in
    `published` (the caller closes them; the originals stay gloo's). No other descriptor
    of the process is touched."""
    published = list(published)
    inodes = _listening_inodes(published)
    found, ours = [], set()
    for name in os.listdir("/proc/self/fd") if inodes else ():
        if int(name) in ours:  # a duplicate of ours, on a number the listing itself had
            continue
        try:
            if os.readlink(f"/proc/self/fd/{name}")[len("socket:["):-1] not in inodes:
                continue
            fd = os.dup(int(name))
        except OSError:  # closed meanwhile
            continue
        ours.add(fd)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # the number went to something else meanwhile
            os.close(fd)
            continue
        try:
            host, port = sock.getsockname()[:2]
            if (sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)  # not reused meanwhile
                    and _is_published(published, sock.family, socket.inet_pton(sock.family, host), port)):
                found.append(sock)
                continue
        except OSError:
            pass
        sock.close()
    return found


def _restrict(published: Iterable[bytes], program: list[Instruction], what: str) -> int:
    """Attach `program` to every listener of ours in `published`; how many took it."""
    try:
        listeners = own_listeners(published)
    except OSError as exc:  # no /proc (not Linux)
        log.warning("nccl: cannot find the gloo listener to %s: %s", what, exc)
        return 0
    if not listeners:
        log.warning("nccl: found no gloo listener to %s: it stays open", what)
    done = 0
    for sock in listeners:
        try:
            _attach(sock, program)
            done += 1
        except OSError as exc:
            log.warning("nccl: the gloo listener on %s stays open (%s failed: %s)", sock.getsockname(), what, exc)
        finally:
            sock.close()
    return done


def admit_only(published: Iterable[bytes], peer_host: str) -> int:
    """While the pair connects: our listeners in `published` take packets from `peer_host` only."""
    program = _source_is(peer_host)
    return 0 if program is None else _restrict(published, program, f"admit only {peer_host}")


def admit_none(published: Iterable[bytes]) -> int:
    """Once the pair is connected: our listeners in `published` take no packet at all."""
    return _restrict(published, [(RET_K, 0, 0, DROP)], "admit none")
