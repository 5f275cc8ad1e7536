"""`ffi.direct.DeviceArena` on a CPU: a stand-in executor library keeps "device memory" in host
buffers, so what the arena copies in (whole, tiled from a pool, sparse blocks) and copies back
(whole or the blocks asked for) can be checked byte for byte."""
import ctypes

import numpy as np
import pytest

from sdpagraph.ffi import direct
from sdpagraph.ffi.direct import DeviceArena, Result, Sparse, Tiled


class FakeLibrary:
    """Device memory in host buffers; `run_graph` doubles operand uid 1 into result uid 2."""

    def __init__(self):
        self.buffers, self.freed, self.copies, self.calls = {}, [], [], []

    def device_alloc(self, device, size):
        buffer = ctypes.create_string_buffer(size)  # zero-filled, as the executor's
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def device_free(self, device, address):
        self.freed.append(address)

    def device_copy(self, device, copies, kind):
        self.calls.append(kind)
        for destination, source, size in copies:  # in order, as on the executor's one stream
            self.copies.append((kind, size))
            ctypes.memmove(destination, source, size)

    def run_graph(self, digest, device, tensors, scalar_uids, scalar_words):
        size = len(self.buffers[tensors[2]])
        given = np.frombuffer(ctypes.string_at(tensors[1], size), np.float32)
        ctypes.memmove(tensors[2], (given * 2).ctypes.data, size)


def device_array(library, address, shape, dtype):
    return np.frombuffer(ctypes.string_at(address, int(np.prod(shape)) * np.dtype(dtype).itemsize), dtype).reshape(shape)


def test_tiled_and_sparse_operands_arrive_whole_and_copy_little(monkeypatch):
    monkeypatch.setattr(direct, "WHOLE_BYTES", 64)
    library = FakeLibrary()
    pool = np.arange(7, dtype=np.float32)
    tiled = Tiled(pool, (3, 5, 4), start=3)
    at = (np.array([0, 2])[:, None], np.array([[1, 4]]))  # broadcast: 2 x 2 blocks, as the check's (B', T')
    sparse = Sparse((3, 5, 4), np.dtype(np.float32), at, np.arange(16, dtype=np.float32).reshape(2, 2, 4) + 1)
    with DeviceArena(0, library) as arena:
        for operand in (tiled, sparse):
            address = arena.put(operand)
            np.testing.assert_array_equal(device_array(library, address, operand.shape, np.float32), np.asarray(operand))
            assert arena.put(operand) == address  # copied once
        # neither travels whole: the pool, and the sparse values, are copied in
        assert max(size for kind, size in library.copies if kind == "to_device") == max(pool.nbytes, 16 * 4) < 240
        other = Tiled(pool, (2, 9), start=5)  # shares the pool: it is not copied in again
        np.testing.assert_array_equal(device_array(library, arena.put(other), other.shape, np.float32), np.asarray(other))
        # the pool, its rotation and doublings; the sparse values at once, then scattered on the device;
        # the other tensor from the pool already there
        assert library.calls == ["to_device", "within_device", "to_device", "within_device", "within_device"]
        starts = np.array([[1, 2], [18, 50]])  # blocks that wrap the pool's end and the tensor's rows
        whole = np.asarray(tiled).reshape(-1)
        for width in (3, 9):  # blocks shorter and longer than the pool
            np.testing.assert_array_equal(tiled.blocks(starts, width), whole[starts[..., None] + np.arange(width)])
        assert whole[0] == pool[3] and whole[4] == pool[0]  # from its start, wrapping
    assert sorted(library.freed) == sorted(library.buffers)  # everything freed on close


@pytest.mark.parametrize("whole_bytes", [16, 1 << 20])  # gathered on the device; small: whole, cut on the host
def test_results_come_back_whole_or_by_tokens(monkeypatch, whole_bytes):
    monkeypatch.setattr(direct, "WHOLE_BYTES", whole_bytes)
    library = FakeLibrary()
    x = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    with DeviceArena(0, library) as arena:
        given = {"y": Result((3, 2, 4), np.float32, [1, 4, 5]), "z": Result((3, 2, 4), np.float32)}
        out = arena.run("0" * 64, {"x": 1, "y": 2, "z": 3}, {"x": x}, given, [], [])
        np.testing.assert_array_equal(out["y"], 2 * x.reshape(6, 4)[[1, 4, 5]])  # the tokens alone
        assert out["z"].shape == (3, 2, 4)  # whole
        if whole_bytes == 16:  # y's tokens gathered on the device (4, 5: one copy), then back with z in one call
            assert library.calls == ["to_device", "within_device", "to_host"]
            assert library.copies[-4:] == [("within_device", 16), ("within_device", 32), ("to_host", 96), ("to_host", 48)]
        else:  # both back whole in one call, y cut on the host
            assert library.calls == ["to_device", "to_host"] and library.copies[-2:] == [("to_host", 96)] * 2
        out = out["y"]
        assert arena.put(out) == arena.put(out)  # a result is already on the device: no copy
        assert ("to_device", 24 * 4) not in library.copies[1:]


def test_an_arena_frees_its_memory_when_a_run_fails():
    library = FakeLibrary()
    with pytest.raises(KeyError):
        with DeviceArena(0, library) as arena:
            arena.run("0" * 64, {"x": 1, "y": 2}, {"x": np.ones(4, np.float32)}, {}, [], [])
    assert len(library.freed) == len(library.buffers) == 1


def test_a_run_copies_in_and_out_in_three_calls():
    """A run's operands (a tiled one among them) arrive before the graph runs, with one call per kind
    of copy: the pool in, the tensor made from it on the device, the result back."""
    library = FakeLibrary()
    pool = np.arange(5, dtype=np.float32) + 1
    with DeviceArena(0, library) as arena:
        tiled = Tiled(pool, (3, 4), start=2)
        out = arena.run("0" * 64, {"x": 1, "y": 2}, {"x": tiled}, {"y": Result((3, 4), np.float32)}, [], [])
        np.testing.assert_array_equal(out["y"], 2 * np.asarray(tiled))
        assert library.calls == ["to_device", "within_device", "to_host"]
