"""Small helpers with no better home."""
from __future__ import annotations

import ipaddress
import struct


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


def available_memory_bytes() -> int:
    """Memory the OS could give this process now without swapping: /proc/meminfo's
    MemAvailable (free pages plus reclaimable caches; else the free physical pages), and no
    more than what this process's cgroup (a container's memory limit) has left."""
    import os

    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = _cgroup_memory_left()
    return available if left is None else min(available, left)


def _cgroup_memory_left() -> int | None:
    """The cgroup's memory limit less its usage (v2, else v1), or None where it sets none."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "no limit" so
            return None
        return max(0, int(limit) - usage)
    return None


def encode_fields(*fields: object) -> bytes:
    """An unambiguous byte encoding of ints, strs and bytes (each tagged, strs and bytes
    length-prefixed): no two different field lists encode alike. What MACs and keyed hashes
    are computed over."""
    out = bytearray()
    for field in fields:
        if isinstance(field, bool) or isinstance(field, int):
            out += b"i" + struct.pack("<q", int(field))
        elif isinstance(field, str):
            data = field.encode()
            out += b"s" + struct.pack("<I", len(data)) + data
        elif isinstance(field, (bytes, bytearray, memoryview)):
            out += b"b" + struct.pack("<I", len(field)) + bytes(field)
        else:
            raise TypeError(f"cannot encode {type(field).__name__}")
    return bytes(out)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; a wildcard or any other address is not."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
