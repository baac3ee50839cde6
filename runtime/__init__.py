"""The engine and its public API: `from glint.runtime import Engine, SamplingParams`.

Imported lazily, so that `glint --help` and the other light entry points do not load jax.
"""
import importlib

_EXPORTS = {"Completion": "glint.runtime.request", "Engine": "glint.runtime.engine",
            "EngineConfig": "glint.runtime.config", "RequestOutput": "glint.runtime.request",
            "SamplingParams": "glint.runtime.params"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'glint.runtime' has no attribute {name!r}")
