"""Fixtures every test file may use, and the XLA flags of a CPU test run."""
import os
import shutil

import numpy as np
import pytest

# On a machine without a GPU every test compiles for XLA:CPU, and most test programs run once: compile
# them with little optimization (40% less time for the suite's 8-device runs, which are compile-bound).
# Set before JAX starts its backend; the subprocess runs inherit it.
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), *CPU_COMPILE_FLAGS]))


@pytest.fixture
def rng():
    """Fresh random inputs per test; the seed is printed, shown when a test fails, to reproduce it."""
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"seed={seed}")
    return np.random.default_rng(seed)
