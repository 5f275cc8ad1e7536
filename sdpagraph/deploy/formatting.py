"""Plain-text forms the command reports share: tables, byte counts and durations.
The ground floor: this module imports nothing from sdpagraph."""
from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned text columns, as `cache ls` and the precompile report print them."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def format_bytes(count: float) -> str:
    """'512 B', '1.5 KiB', '2.0 GiB'."""
    exponent = 0
    while count >= 1024 and exponent < len(_BYTE_UNITS) - 1:
        count /= 1024
        exponent += 1
    return f"{count:.0f} B" if exponent == 0 else f"{count:.1f} {_BYTE_UNITS[exponent]}"


def format_age(seconds: float) -> str:
    """A duration: '12 s', '3.5 min', '2.0 h', '1.2 d'."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(seconds, 0):.0f} s"
