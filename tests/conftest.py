"""Fixtures every test file may use."""
import numpy as np
import pytest


@pytest.fixture
def rng():
    """Fresh random inputs per test; the seed is printed, shown when a test fails, to reproduce it."""
    seed = np.random.SeedSequence().entropy % 2**32
    print(f"seed={seed}")
    return np.random.default_rng(seed)
