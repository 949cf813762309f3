"""How the planner writes quantities: bytes in their unit, plurals."""

from __future__ import annotations


def size(n_bytes: float) -> str:
    """``69.8 GB``, ``12.50 MB``, ``4.1 kB``: bytes in the unit their size calls for (powers of 1000, as ``GB``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def plural(word: str) -> str:
    return word + ("es" if word.endswith("s") else "s")
