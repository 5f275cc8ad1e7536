"""A measurement in a fresh Python process: cold caches and one config per process.

    run_child(code, args, env=None, timeout=900, label="") -> dict

The child runs `python -c code *args` with the repository on PYTHONPATH and XLA's GPU memory not
preallocated (and Python's fault handler on), and prints its result as one line `RESULT {json}`; that dict is returned. A child
that fails or prints no result raises RuntimeError with `label` and the end of its output.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "RESULT "


def run_child(code: str, args: Sequence[str], env: Mapping[str, str] | None = None, timeout: int = 900,
              label: str = "") -> dict:
    # PYTHONFAULTHANDLER: a child that crashes in native code prints its Python stack.
    environment = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONFAULTHANDLER": "1", **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, environment.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code, *args], env=environment, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX):])
