"""The one converter of setting values: a flag, a `PDSERVE_*` string or a YAML value becomes
the type of the setting's default. Strict: "maybe" is not a bool, 1.5 is not an int."""
from __future__ import annotations

from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected true or false")


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("expected an integer")
        return int(value)
    return int(str(value).strip())


def to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    return float(str(value).strip()) if isinstance(value, str) else float(value)


def to_str(value: Any) -> str:
    return str(value).strip()


def coerce(value: Any, default: Any) -> Any:
    """`value` as the type of `default` (bool, int, float, else str). ValueError if it is not one."""
    for kind, convert in ((bool, to_bool), (int, to_int), (float, to_float)):
        if isinstance(default, kind):
            return convert(value)
    return to_str(value)
