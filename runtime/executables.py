"""Compiled executables kept between processes, so a warm start neither traces nor compiles (GPUs only).

JAX's persistent cache is keyed by the lowered program, so every process still traces the model once per
program before it finds the executable (13 s of a llama3-8b warm start on the H200). This cache is keyed
by what the lowering depends on instead: the program's name and identity (model, cache geometry, kernels),
glint's own source and kernel tuning values, the jax/jaxlib versions, the GPU and XLA_FLAGS. Entries live
beside JAX's, in `$GLINT_CACHE_DIR/executables/`. XLA:CPU executables do not survive serialization, so on a
CPU this cache is off and JAX's cache alone is used. A damaged entry is logged and compiled again.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import re
import tempfile

import jax
import jaxlib
from glint.pallas_kernels import tuning
from jax._src import config as jax_config

log = logging.getLogger(__name__)
counts: collections.Counter = collections.Counter()  # "loaded" and "stored" entries, in this process

SOURCE_PACKAGES = ("model", "kvcache", "pallas_kernels", "runtime", "export")
MAX_BYTES = 8 << 30  # kept executables beyond this are dropped, least recently used first


@functools.cache
def source_digest() -> str:
    """sha256 of glint's Python sources: an edit to any of them makes new keys."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key(identity: str, name: str) -> str:
    """Everything the lowered program depends on besides its identity: glint's source, versions, the GPU and
    its driver, XLA_FLAGS, JAX's settings that enter tracing (PRNG implementation, matmul precision, ...) and the
    kernels' tuning values as they are now (a process may set them, as the A/B tools do, without a source edit)."""
    device = jax.devices()[0]
    parts = (identity, name, source_digest(), jax.__version__, jaxlib.__version__, device.device_kind,
             device.client.platform_version, os.environ.get("XLA_FLAGS", ""), _settings(), _tuning())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _tuning() -> str:
    """pallas_kernels/tuning.py's constants, as this process has them."""
    return repr(sorted((k, v) for k, v in vars(tuning).items() if k.isupper()))


def _settings() -> str:
    """JAX's trace-affecting settings, without the object addresses some of their reprs carry."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(jax_config.trace_context()))


def folder() -> pathlib.Path | None:
    """Where entries go: beside JAX's persistent cache when it is on and this is a GPU, else None (off)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or jax.default_backend() != "gpu":
        return None
    return pathlib.Path(cache) / "executables"


def to_bytes(compiled: jax.stages.Compiled) -> bytes:
    """A compiled program as bytes (a pickle: load only what you trust)."""
    from jax.experimental.serialize_executable import serialize

    return pickle.dumps(serialize(compiled))


def from_bytes(data: bytes) -> jax.stages.Compiled:
    from jax.experimental.serialize_executable import deserialize_and_load

    return deserialize_and_load(*pickle.loads(data))


def load(identity: str, name: str) -> jax.stages.Compiled | None:
    where = folder()
    path = where / f"{key(identity, name)}.bin" if where else None
    if path is None or not path.is_file():
        return None
    try:
        compiled = from_bytes(path.read_bytes())  # trusted: this user's own cache
        os.utime(path)  # recently used: pruned last
        counts["loaded"] += 1
        return compiled
    except Exception as e:  # a damaged entry: compile again (and overwrite it)
        log.warning("cached executable %s could not be loaded (%s: %s); compiling", path, type(e).__name__, e)
        return None


def prune(where: pathlib.Path, max_bytes: int = MAX_BYTES) -> None:
    """Drop the least recently used entries (by modification time) beyond `max_bytes`."""
    entries = sorted(where.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for path in entries:
        total += path.stat().st_size
        if total > max_bytes:
            path.unlink(missing_ok=True)


def store(identity: str, name: str, compiled: jax.stages.Compiled) -> None:
    where = folder()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"{key(identity, name)}.bin"
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(to_bytes(compiled))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old entry or the new one
        counts["stored"] += 1
        prune(where)
    except Exception as e:  # a read-only or full disk costs the next start a compile, nothing more
        log.warning("could not store the executable of %s in %s (%s: %s)", name, where, type(e).__name__, e)
