"""Small helpers with no better home."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)
