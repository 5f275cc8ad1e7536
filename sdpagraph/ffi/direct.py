"""Running a registered graph once, outside XLA, on buffers the caller fills from the host.

    with DeviceArena(device) as arena:
        results = arena.run(digest, uids, operands, results, scalar_uids, scalar_words)

The numerical check (`numerics.direct`) runs each freshly built graph once on random
inputs. Through XLA that needed a program compiled per config, which took longer than building the
graph; here the executor runs the graph directly (csrc/direct.cc): device memory the arena
allocates (zero-filled) and frees, copies in and out, and one synchronous run on a stream of the
executor's own.

Operands are host arrays, or two lighter forms that keep the check's host-device traffic small
at large shapes: a `Tiled` array (a random pool repeated from a start: the pool is copied in once
per arena, and each tensor is made from it and doubled on the device) and a `Sparse` one (zeros
but for some contiguous blocks: the blocks' values are copied in at once and scattered on the
device). A result can name the tokens the caller will read (`Result.tokens`); only those come
back (small results whole, then cut on the host; large ones gathered on the device, then copied at
once). A run's copies are queued and made in at most three calls (in, within the device, out),
each on one stream. An operand is copied to the device
once per arena (a result fed back as the next graph's operand is not copied at all), and every
allocation is freed when the arena closes, also when a run raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from sdpagraph.ffi.loader import ExecutorLib, _loaded

# Below this many bytes an array travels whole: one copy costs less than many small ones.
WHOLE_BYTES = 8 << 20
_FLUSH_ORDER = ("to_device", "within_device", "to_host")


@dataclass(frozen=True, eq=False)
class Tiled:
    """An array of `shape` whose flat element i is pool[(start + i) % len(pool)]: tensors can share
    one pool at different starts."""

    pool: np.ndarray  # 1-D
    shape: tuple[int, ...]
    start: int = 0

    @property
    def dtype(self) -> np.dtype:
        return self.pool.dtype

    def blocks(self, starts: Any, width: int) -> np.ndarray:
        """The `width` consecutive flat elements from each flat index in `starts`, as an array of
        shape starts.shape + (width,), without materializing the whole array."""
        size = len(self.pool)
        at = (np.asarray(starts) + self.start) % size
        if width > size:
            return self.pool[(at[..., None] + np.arange(width)) % size]
        out = np.lib.stride_tricks.sliding_window_view(self.pool, width)[np.minimum(at, size - width)]
        wrapping = at > size - width  # the few blocks that run past the pool's end
        out[wrapping] = self.pool[(at[wrapping][:, None] + np.arange(width)) % size]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rotated = np.concatenate((self.pool[self.start:], self.pool[:self.start]))
        whole = np.resize(rotated, int(np.prod(self.shape))).reshape(self.shape)
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True, eq=False)
class Sparse:
    """Zeros of `shape` but at `at` (a tuple of index arrays over the leading axes), which hold
    `values`: each indexed position is a contiguous block of the trailing axes."""

    shape: tuple[int, ...]
    dtype: np.dtype
    at: tuple[np.ndarray, ...]
    values: np.ndarray

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.zeros(self.shape, self.dtype)
        whole[self.at] = self.values
        return whole if dtype is None else whole.astype(dtype)


class Result(NamedTuple):
    """A graph result to copy back: its shape, dtype, and the tokens the caller reads (indices into
    its first two axes flattened, each a contiguous block of the trailing axes), which come back
    alone, as an array (len(tokens), *shape[2:]); None: all of it, as an array of `shape`."""

    shape: tuple[int, ...]
    dtype: Any
    tokens: Sequence[int] | None = None


class DeviceArena:
    """Device memory for direct runs on one device (a CUDA ordinal), freed on close."""

    def __init__(self, device: int, library: ExecutorLib | None = None) -> None:
        self.device = int(device)
        self._library = library or _loaded()
        self._allocations: list[int] = []
        self.allocated_bytes = 0  # all of it held until close: the arena's peak device memory
        self._on_device: dict[int, tuple[Any, int]] = {}  # id(operand) -> (operand, address)
        # Copies queued until the next flush, one executor call per kind: each call waits for its
        # copies, and at B4 T4096 sixteen calls cost 10 ms. The host arrays they read are kept alive.
        self._queued: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in _FLUSH_ORDER}
        self._sources: list[np.ndarray] = []

    def __enter__(self) -> "DeviceArena":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        allocations, self._allocations, self._on_device = self._allocations, [], {}
        self._queued, self._sources = {kind: [] for kind in _FLUSH_ORDER}, []
        for address in allocations:
            self._library.device_free(self.device, address)

    def _allocate(self, size: int) -> int:
        address = self._library.device_alloc(self.device, max(int(size), 1))
        self._allocations.append(address)
        self.allocated_bytes += int(size)
        return address

    def _copy(self, copies: Sequence[tuple[int, int, int]], kind: str, *sources: np.ndarray) -> None:
        """Queues (destination, source, bytes) copies of one kind; `sources`: host arrays they read."""
        self._queued[kind].extend(copies)
        self._sources.extend(sources)

    def _flush(self) -> None:
        """Makes the queued copies: host to device, then within the device (reading what came in),
        then to the host (reading what was gathered); each kind in one call, on one stream."""
        for kind in _FLUSH_ORDER:
            copies, self._queued[kind] = self._queued[kind], []
            if copies:
                self._library.device_copy(self.device, copies, kind)
        self._sources = []

    def put(self, operand: Any) -> int:
        """The device address of a copy of `operand` (a C-contiguous host array, `Tiled` or
        `Sparse`), copied once per arena."""
        address = self._place(operand)
        self._flush()
        return address

    def _place(self, operand: Any) -> int:
        """`put` with the copies queued."""
        known = self._on_device.get(id(operand))
        if known is not None and known[0] is operand:
            return known[1]
        if isinstance(operand, Tiled):
            address = self._put_tiled(operand)
        elif isinstance(operand, Sparse) and int(np.prod(operand.shape)) * operand.dtype.itemsize > WHOLE_BYTES:
            address = self._put_sparse(operand)
        else:
            host = np.ascontiguousarray(operand)
            address = self._allocate(host.nbytes)
            self._copy([(address, host.ctypes.data, host.nbytes)], "to_device", host)
        self._on_device[id(operand)] = (operand, address)
        return address

    def _put_tiled(self, tiled: Tiled) -> int:
        item, total = tiled.dtype.itemsize, int(np.prod(tiled.shape)) * tiled.dtype.itemsize
        pool = self._place(tiled.pool)  # copied in once for every tensor that shares it
        address = self._allocate(total)
        copies, filled = [], 0
        for offset, count in ((tiled.start, len(tiled.pool) - tiled.start), (0, tiled.start)):  # from its start
            size = min(count * item, total - filled)
            if size > 0:
                copies.append((address + filled, pool + offset * item, size))
                filled += size
        while filled < total:  # double what is there: its length stays a multiple of the pool's
            step = min(filled, total - filled)
            copies.append((address + filled, address, step))  # in order on one stream: each reads the last
            filled += step
        self._copy(copies, "within_device")
        return address

    def _put_sparse(self, sparse: Sparse) -> int:
        block = int(np.prod(sparse.shape[len(sparse.at):]))
        address = self._allocate(int(np.prod(sparse.shape)) * sparse.dtype.itemsize)
        starts = np.ravel_multi_index(np.broadcast_arrays(*sparse.at), sparse.shape[:len(sparse.at)]).reshape(-1)
        values = np.ascontiguousarray(np.asarray(sparse.values, sparse.dtype).reshape(len(starts), block))
        size = block * sparse.dtype.itemsize
        staging = self._allocate(values.nbytes)  # one copy in, then the blocks scattered on the device
        self._copy([(staging, values.ctypes.data, values.nbytes)], "to_device", values)
        self._copy([(address + int(start) * size, staging + row * size, size) for row, start in enumerate(starts)],
                   "within_device")
        return address

    def run(self, digest: str, uids: Mapping[str, int], operands: Mapping[str, Any], results: Mapping[str, Result],
            scalar_uids: Any, scalar_words: Any) -> dict[str, np.ndarray]:
        """Runs the registered graph `digest` on `operands` (role -> operand) and returns its
        `results` (role -> `Result`) as host arrays: whole, or the tokens asked for;
        `uids`: role -> the graph's tensor uid. A returned array passed as a later run's operand is
        the whole device result it came from (not copied back in)."""
        tensors = {uids[role]: self._place(operand) for role, operand in operands.items()}
        outputs = {}
        for role, result in results.items():
            item = np.dtype(result.dtype).itemsize
            tensors[uids[role]] = address = self._allocate(int(np.prod(result.shape)) * item)
            rows = None if result.tokens is None else np.asarray(result.tokens, np.int64)
            host = np.empty(result.shape if rows is None else (len(rows), *result.shape[2:]), result.dtype)
            self._on_device[id(host)] = (host, address)
            outputs[role] = (host, address, rows)
        self._flush()
        self._library.run_graph(digest, self.device, tensors, scalar_uids, scalar_words)
        small, gathered = [], []  # cut on the host after the copies; gathered on the device first
        for role, (host, address, rows) in outputs.items():
            if rows is not None and int(np.prod(results[role].shape)) * host.itemsize > WHOLE_BYTES:
                gathered.append((host, address, rows))
                continue
            everything = host if rows is None else np.empty(results[role].shape, host.dtype)
            self._copy([(everything.ctypes.data, address, everything.nbytes)], "to_host")
            if rows is not None:  # small: copied back whole, the tokens taken on the host
                small.append((host, everything, rows))
        for host, address, rows in gathered:
            self._tokens_to_host(host, address, rows)
        self._flush()
        for host, everything, rows in small:
            host[...] = everything.reshape(-1, *host.shape[1:])[rows]
        return {role: host for role, (host, _, _) in outputs.items()}

    def _tokens_to_host(self, host: np.ndarray, address: int, rows: np.ndarray) -> None:
        """Queues rows `rows` of the device array at `address` into `host` (len(rows) rows): gathered
        on the device into one buffer that is copied back at once. Hundreds of small copies to
        pageable host memory cost more, and so did a whole-shape host array: writing blocks into it
        faulted in (and zeroed) most of its pages."""
        if not len(rows):
            return
        size = host.nbytes // len(rows)
        staging = self._allocate(host.nbytes)
        starts = np.flatnonzero(np.r_[True, np.diff(rows) != 1])  # runs of adjacent rows: one copy each
        ends = np.r_[starts[1:], len(rows)]
        self._copy([(staging + int(first) * size, address + int(rows[first]) * size, int(last - first) * size)
                    for first, last in zip(starts, ends)], "within_device")
        self._copy([(host.ctypes.data, staging, host.nbytes)], "to_host")
