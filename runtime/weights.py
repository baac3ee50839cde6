"""Reading an orbax weights folder (what `glint convert` and `glint export` write) straight onto the device.

orbax's own restore reads the arrays with tensorstore but copies each one to the device from its single event
loop thread, which held llama3-8b's 16 GB to ~2.1 GB/s on the H200 (docs/perf.md). Here a pool of threads each
reads one array with tensorstore (which releases the GIL), largest first, and hands it to a pool of threads that
copy to the device, so reads and host-to-device copies overlap; reads run ahead of the copies by at most
`read_ahead_bytes` of host memory, which also lets them go on while the device is still starting (a process's
first device_put waits for the client and its memory pool: 2.2 s on the H200). Memory-mapping the
files instead was slower and erratic on the H200 machine (1.5-4.6 GB/s against a steady 3.4-3.6). No
glint.model import: exported artifacts load through this too.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import threading

import jax
import numpy as np

NUM_THREADS = 16
_METADATA = "_METADATA"


def decode_weight_bytes(params, tie_embeddings: bool) -> int:
    """Bytes of weights one decode step reads from `params` (arrays or ShapeDtypeStructs): every weight once,
    except the embedding table (one row per token) unless it is tied to the head."""
    def nbytes(x) -> int:
        return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize

    total = sum(nbytes(x) for x in jax.tree.leaves(params))
    return total if tie_embeddings else total - nbytes(params["embed"])


def default_read_ahead() -> int:
    """Host memory the reads may run ahead of the device copies: a quarter of RAM, at most 16 GiB."""
    return min(16 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)


class _Budget:
    """Bytes of host memory in flight between reading and copying."""

    def __init__(self, limit: int):
        self.limit, self.free, self.cond = limit, limit, threading.Condition()

    def take(self, n: int) -> int:
        n = min(n, self.limit)  # an array larger than the budget goes alone
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def give(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()


def stored_names(folder: pathlib.Path) -> tuple[list[str], dict]:
    """The flat array names an orbax folder holds, and its metadata (ValueError if it is not one)."""
    path = folder / _METADATA
    try:
        meta = json.loads(path.read_text())
        names = [".".join(str(k["key"]) for k in entry["key_metadata"]) for entry in meta["tree_metadata"].values()]
    except FileNotFoundError:
        raise ValueError(f"{folder}: the weights could not be read: {_METADATA} is missing") from None
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{folder}: the weights could not be read: {_METADATA} is not orbax checkpoint metadata "
                         f"({type(e).__name__}: {e})") from None
    return names, meta


def _spec(folder: pathlib.Path, name: str, meta: dict) -> dict:
    from orbax.checkpoint._src.serialization import tensorstore_utils

    # As orbax reads them: without the flag, OCDBT when its manifest is there; chunks equal to the fill value
    # may be missing unless the writer stored them all.
    use_ocdbt = meta["use_ocdbt"] if meta.get("use_ocdbt") is not None else (folder / "manifest.ocdbt").exists()
    return tensorstore_utils.ArrayReadSpec(
        str(folder), name, use_zarr3=bool(meta.get("use_zarr3")),
        use_ocdbt=bool(use_ocdbt),
        raise_array_data_missing_error=bool(meta.get("store_array_data_equal_to_fill_value", False))).json


def ts_context(num_threads: int):
    import tensorstore as ts

    return ts.Context({"file_io_concurrency": {"limit": 128}, "data_copy_concurrency": {"limit": num_threads},
                       "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})  # orbax's B-tree node cache


def start_device() -> concurrent.futures.Future:
    """The first device, started in a thread of its own: the client up and its memory pool allocated, which a
    process's first device_put otherwise waits for (reading weights from disk meanwhile hides it)."""
    def start() -> jax.Device:
        device = jax.devices()[0]
        jax.device_put(np.zeros((), np.float32), device).block_until_ready()
        return device

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(start)
    pool.shutdown(wait=False)
    return future


def read_params(folder, like: dict, device: jax.Device | concurrent.futures.Future | None = None, *,
                num_threads: int = NUM_THREADS, read_ahead_bytes: int | None = None,
                place=None) -> dict[str, jax.Array]:
    """{name: array on `device`} for every name of `like` ({name: ShapeDtypeStruct or array}) from the orbax
    folder `folder`; arrays stored in another dtype are cast to `like`'s. ValueError naming the folder and the
    array for a missing, unexpected, mis-shaped or unreadable array. `device` may be `start_device()`'s future:
    the reads begin while it starts. `place(name, host array)`, given, puts each array instead (tensor
    parallelism: its shards onto their devices, model/tp.py)."""
    import tensorstore as ts

    folder = pathlib.Path(folder).absolute()
    names, meta = stored_names(folder)
    missing, unexpected = sorted(set(like) - set(names)), sorted(set(names) - set(like))
    if missing or unexpected:
        raise ValueError(f"{folder}: the stored weights do not match the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    if device is None:
        device = jax.devices()[0]
    context = ts_context(num_threads)
    opening = {name: ts.open(_spec(folder, name, meta), open=True, context=context) for name in like}
    stores = {}
    for name, future in opening.items():  # every array's metadata before any data: a bad one fails at once
        try:
            stores[name] = future.result()
        except Exception as e:  # tensorstore's errors for missing or damaged files
            raise ValueError(f"{folder}: the weights could not be read: array {name!r} could not be opened "
                             f"({type(e).__name__}: {e})") from None
        if tuple(stores[name].shape) != tuple(like[name].shape):
            raise ValueError(f"{folder}: array {name!r} is stored with shape {tuple(stores[name].shape)}, the "
                             f"model expects {tuple(like[name].shape)}")

    def nbytes(name: str) -> int:
        return int(np.prod(like[name].shape)) * np.dtype(like[name].dtype).itemsize

    budget = _Budget(read_ahead_bytes or default_read_ahead())
    readers, copiers = (concurrent.futures.ThreadPoolExecutor(num_threads) for _ in range(2))

    def copy(name: str, host: np.ndarray, held: int) -> tuple[str, jax.Array]:
        try:
            if place is not None:
                return name, jax.block_until_ready(place(name, host))
            target = device.result() if isinstance(device, concurrent.futures.Future) else device
            return name, jax.block_until_ready(jax.device_put(host, target))
        finally:
            budget.give(held)

    def read(name: str) -> concurrent.futures.Future:
        held = budget.take(nbytes(name))
        try:
            host = np.asarray(stores[name].read().result())
            if host.dtype != np.dtype(like[name].dtype):
                host = host.astype(like[name].dtype)
        except Exception as e:
            budget.give(held)
            raise ValueError(f"{folder}: the weights could not be read: array {name!r} ({type(e).__name__}: "
                             f"{e})") from None
        return copiers.submit(copy, name, host, held)

    try:
        reads = [readers.submit(read, name) for name in sorted(like, key=nbytes, reverse=True)]
        loaded = dict(future.result().result() for future in reads)
    finally:  # on a failure, the arrays not yet begun are not read
        for pool in (readers, copiers):
            pool.shutdown(wait=True, cancel_futures=True)
    return {name: loaded[name] for name in like}  # on the device: every copy was waited for
