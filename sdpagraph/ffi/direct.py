"""Running a registered graph once, outside XLA, on buffers the caller fills from the host.

    with DeviceArena(device) as arena:
        results = arena.run(graph, digest, operands, result_specs, scalar_uids, scalar_words)

The numerical check (`jax_api.numerics_direct`) runs each freshly built graph once on random
inputs. Through XLA that needed a program compiled per config, which took longer than building the
graph; here the executor runs the graph directly (executor.cc, section 8): device memory the arena
allocates and frees, copies in and out, and one synchronous run on a stream of the executor's own.

Host arrays given as operands are copied to the device once per arena (a result fed back as the
next graph's operand is not copied again), and every allocation is freed when the arena closes,
also when a run raises.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from sdpagraph.ffi.loader import ExecutorLib, _loaded


class DeviceArena:
    """Device memory for direct runs on one device (a CUDA ordinal), freed on close."""

    def __init__(self, device: int, library: ExecutorLib | None = None) -> None:
        self.device = int(device)
        self._library = library or _loaded()
        self._allocations: list[int] = []
        self.allocated_bytes = 0  # all of it held until close: the arena's peak device memory
        self._on_device: dict[int, tuple[np.ndarray, int]] = {}  # id(host array) -> (array, address)

    def __enter__(self) -> "DeviceArena":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        allocations, self._allocations, self._on_device = self._allocations, [], {}
        for address in allocations:
            self._library.device_free(self.device, address)

    def _allocate(self, size: int) -> int:
        address = self._library.device_alloc(self.device, max(int(size), 1))
        self._allocations.append(address)
        self.allocated_bytes += int(size)
        return address

    def put(self, array: np.ndarray) -> int:
        """The device address of a copy of `array` (C-contiguous), copied once per arena."""
        known = self._on_device.get(id(array))
        if known is not None and known[0] is array:
            return known[1]
        host = np.ascontiguousarray(array)
        address = self._allocate(host.nbytes)
        self._library.device_copy(self.device, address, host.ctypes.data, host.nbytes, to_device=True)
        self._on_device[id(array)] = (array, address)
        return address

    def empty(self, shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, int]:
        """A host array and a zero-filled device buffer of its size, which `get` copies into it (and
        `put` of that host array gives back, without copying)."""
        host = np.empty(shape, dtype)
        address = self._allocate(host.nbytes)
        self._on_device[id(host)] = (host, address)
        return host, address

    def get(self, host: np.ndarray) -> np.ndarray:
        """`host` (from `empty`) filled with its device buffer's contents."""
        _, address = self._on_device[id(host)]
        self._library.device_copy(self.device, host.ctypes.data, address, host.nbytes, to_device=False)
        return host

    def run(self, digest: str, uids: Mapping[str, int], operands: Mapping[str, np.ndarray],
            results: Mapping[str, tuple[tuple[int, ...], Any]], scalar_uids: Any, scalar_words: Any) -> dict[str, np.ndarray]:
        """Runs the registered graph `digest` on `operands` (role -> host array) and returns its
        `results` (role -> (shape, dtype)) as host arrays; `uids`: role -> the graph's tensor uid."""
        tensors = {uids[role]: self.put(array) for role, array in operands.items()}
        outputs = {}
        for role, (shape, dtype) in results.items():
            outputs[role], tensors[uids[role]] = self.empty(shape, dtype)
        self._library.run_graph(digest, self.device, tensors, scalar_uids, scalar_words)
        return {role: self.get(host) for role, host in outputs.items()}
