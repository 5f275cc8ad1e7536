"""Several CPU devices for the multi-device tests: running a test file again in a subprocess with
them (the rest of the suite has one), and meshes of either axis type."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

try:
    from jax.sharding import AxisType
except ImportError:  # JAX before mesh axis types: every axis is what later became Auto
    AxisType = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_explicit = pytest.mark.skipif(AxisType is None, reason="this JAX has no AxisType.Explicit")
AXIS_TYPES = ["auto", pytest.param("explicit", marks=needs_explicit)]  # parametrize a test's `axis_type`


def has_cpu_devices(count: int) -> bool:
    return jax.default_backend() == "cpu" and jax.device_count() >= count


def rerun_with_cpu_devices(path: str, count: int, timeout: int = 900) -> None:
    """Run the test file `path` with `--xla_force_host_platform_device_count=count`; fail with its output."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", path],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def on_axis_types(cases: list[tuple], explicit: list[tuple]) -> list:
    """Parameters for a test's `(*case, axis_type)`: every case on Auto axes, and the cases in
    `explicit` on Explicit axes too (the whole matrix twice would double its time)."""
    assert set(explicit) <= set(cases), set(explicit) - set(cases)
    return [*(case + ("auto",) for case in cases),
            *(pytest.param(*case, "explicit", marks=needs_explicit) for case in explicit)]


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], axis_type: str = "auto") -> Mesh:
    """A mesh over the first prod(shape) devices, every axis of `axis_type` ("auto" or "explicit")."""
    devices = jax.devices()[:int(np.prod(shape))]
    if AxisType is None:
        return Mesh(np.array(devices).reshape(shape), names)
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names), devices=devices)
