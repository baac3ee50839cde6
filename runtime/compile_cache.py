"""JAX's persistent compilation cache, on by default for every engine and command.

Compiled programs are stored in `$GLINT_CACHE_DIR` (default: JAX's own cache folder when the user set one
with JAX_COMPILATION_CACHE_DIR, else `~/.cache/glint`), so a second process loads them instead of
compiling. The cache is process-wide (JAX settings: every jit of the process may use it, programs of any
compile time are kept, least recently used entries go beyond MAX_BYTES); `configure(False)` turns it off.
A corrupted or unreadable entry is not fatal: JAX warns and compiles instead.
"""
from __future__ import annotations

import logging
import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache

log = logging.getLogger(__name__)


# Beyond this size the least recently used entries go (each new entry then scans the folder, under a lock);
# $GLINT_CACHE_MAX_BYTES=-1 keeps everything and skips the scan (the test suite, which writes thousands).
MAX_BYTES = int(os.environ.get("GLINT_CACHE_MAX_BYTES", 16 << 30))


def cache_dir() -> pathlib.Path:
    folder = os.environ.get("GLINT_CACHE_DIR") or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return pathlib.Path(folder or pathlib.Path.home() / ".cache" / "glint").expanduser()


def configure(enabled: bool = True, path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Point JAX's persistent cache at `path` (default `cache_dir()`), caching every program whatever its
    compile time or size; or turn it off. Returns the directory in use, or None."""
    target = None
    if enabled:
        target = pathlib.Path(path) if path is not None else cache_dir()
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("compilation cache %s is not usable (%s); compiling without it", target, e)
            target = None
    current = jax.config.jax_compilation_cache_dir
    if (str(target) if target else None) != current:
        jax.config.update("jax_compilation_cache_dir", str(target) if target else None)
        compilation_cache.reset_cache()  # JAX decides once per process whether to use the cache: ask again
    if target is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return target
