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


def write(out: str, stem: str, setup: str, text: str, data: Any) -> None:
    """Print the table and write OUT/STEM.md (device, jax, date, `setup`, then the table) and
    OUT/STEM.json (`data`)."""
    print(text)
    os.makedirs(out, exist_ok=True)
    header = f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {time.strftime('%Y-%m-%d')}; {setup}\n\n"
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(header + text + "\n")
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(data, f, indent=1)
