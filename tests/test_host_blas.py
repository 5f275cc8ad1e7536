"""`numerics.host_blas.few_blas_threads`: NumPy's OpenBLAS on at most FEW_THREADS inside the block, its own
count back after the last block ends, also across threads and when the block raises."""
import threading

import numpy as np
import pytest

from sdpagraph.numerics import host_blas


@pytest.fixture
def blas():
    controls = host_blas._controls()
    if not controls:
        pytest.skip("NumPy's BLAS here is not a loaded OpenBLAS")
    getter, setter = controls[0]
    before = getter()
    setter(host_blas.FEW_THREADS + 3)  # more than a few, so that "restored" is not "the same by chance"
    yield getter
    setter(before)


def test_one_thread_inside_and_the_count_restored_after(blas):
    with host_blas.few_blas_threads():
        assert blas() == host_blas.FEW_THREADS
        with host_blas.few_blas_threads():
            assert blas() == host_blas.FEW_THREADS
        assert blas() == host_blas.FEW_THREADS  # the outer block is still open
        a = np.random.default_rng(0).standard_normal((64, 64))
        np.testing.assert_allclose(a @ np.eye(64), a)
    assert blas() == host_blas.FEW_THREADS + 3
    with pytest.raises(ZeroDivisionError):
        with host_blas.few_blas_threads():
            1 / 0
    assert blas() == host_blas.FEW_THREADS + 3


def test_blocks_in_two_threads_restore_when_the_last_ends(blas):
    inside, release = threading.Event(), threading.Event()

    def other():
        with host_blas.few_blas_threads():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with host_blas.few_blas_threads():
        thread.start()
        inside.wait(10)
    assert blas() == host_blas.FEW_THREADS  # the other thread's block is still open
    release.set()
    thread.join(10)
    assert blas() == host_blas.FEW_THREADS + 3
