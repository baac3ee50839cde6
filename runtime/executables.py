"""Compiled executables kept between processes, so a warm start neither traces nor compiles (GPUs only).

JAX's persistent cache is keyed by the lowered program, so every process still traces the model once per
program before it finds the executable (13 s of a llama3-8b warm start on the H200). This cache is keyed
by what the lowering depends on instead: the program's name and identity (model, cache geometry, kernels),
glint's own source, the jax/jaxlib versions, the GPU and XLA_FLAGS. Entries live beside JAX's, in
`$GLINT_CACHE_DIR/executables/`. XLA:CPU executables do not survive serialization, so on a CPU this cache
is off and JAX's cache alone is used. A damaged entry is logged and compiled again.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import pathlib
import pickle

import jax
import jaxlib

log = logging.getLogger(__name__)
counts: collections.Counter = collections.Counter()  # "loaded" and "stored" entries, in this process

SOURCE_PACKAGES = ("model", "kvcache", "pallas_kernels", "runtime", "export")


@functools.cache
def source_digest() -> str:
    """sha256 of glint's Python sources: an edit to any of them makes new keys."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).glob("*.py")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def key(identity: str, name: str) -> str:
    parts = (identity, name, source_digest(), jax.__version__, jaxlib.__version__, jax.devices()[0].device_kind,
             os.environ.get("XLA_FLAGS", ""))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def folder() -> pathlib.Path | None:
    """Where entries go: beside JAX's persistent cache when it is on and this is a GPU, else None (off)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or jax.default_backend() != "gpu":
        return None
    return pathlib.Path(cache) / "executables"


def load(identity: str, name: str) -> jax.stages.Compiled | None:
    where = folder()
    path = where / f"{key(identity, name)}.bin" if where else None
    if path is None or not path.is_file():
        return None
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        compiled = deserialize_and_load(*pickle.loads(path.read_bytes()))
        counts["loaded"] += 1
        return compiled
    except Exception as e:  # a damaged entry: compile again (and overwrite it)
        log.warning("cached executable %s could not be loaded (%s: %s); compiling", path, type(e).__name__, e)
        return None


def store(identity: str, name: str, compiled: jax.stages.Compiled) -> None:
    where = folder()
    if where is None:
        return
    from jax.experimental.serialize_executable import serialize

    try:
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"{key(identity, name)}.bin"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(serialize(compiled)))
        tmp.replace(path)  # atomic: a concurrent reader sees the old entry or the new one
        counts["stored"] += 1
    except Exception as e:  # a read-only or full disk costs the next start a compile, nothing more
        log.warning("could not store the executable of %s in %s (%s: %s)", name, where, type(e).__name__, e)
