"""Running a test file again in a subprocess with several CPU devices (the rest of the suite has one)."""
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
