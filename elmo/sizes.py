"""Byte counts as people read them, in messages, summaries and tables: the one formatter (torch-free, so the
serving side uses it too)."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


def human_bytes(n: int | float) -> str:
    """1.5 GiB, 64.0 MiB, 12.0 KiB, 300 bytes (binary units, one decimal)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


__all__ = ["GIB", "KIB", "MIB", "human_bytes"]
