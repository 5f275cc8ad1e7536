"""What the GPU benchmarks share around their measurements: the GPU check and the written report."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax


def gpu_missing(script: str) -> bool:
    """True (after saying so on stderr) when JAX sees no GPU: the caller exits with 2."""
    if [d for d in jax.devices() if d.platform == "gpu"]:
        return False
    print(f"{script} needs a GPU; none visible", file=sys.stderr)
    return True


def markdown_table(rows: list[dict]) -> str:
    """A markdown table of dict rows: the columns in first-seen order, floats to 4 significant digits,
    a cell a row lacks left empty."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(results: dict[str, list[dict]], parts: Any) -> str:
    """The tables of `results[part]` for each of `parts` that has rows, a blank line apart."""
    return "\n\n".join(markdown_table(results[part]) for part in parts if results[part])


def save(out: str | None, stem: str, markdown: str, data: Any) -> None:
    """Write OUT/STEM.md (`markdown`) and OUT/STEM.json (`data`); nothing without `out`. Benchmarks call
    it after every row, so a run cut short keeps what it measured."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(data, f, indent=1, default=str)


def write(out: str, stem: str, setup: str, text: str, data: Any) -> None:
    """Print the table and write OUT/STEM.md (device, jax, date, `setup`, then the table) and
    OUT/STEM.json (`data`)."""
    print(text)
    header = f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {time.strftime('%Y-%m-%d')}; {setup}\n\n"
    save(out, stem, header + text, data)
