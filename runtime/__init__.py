"""The engine and its public API: `from glint.runtime import Engine, SamplingParams`."""

from glint.runtime.config import EngineConfig
from glint.runtime.engine import Engine
from glint.runtime.params import SamplingParams
from glint.runtime.request import Completion, RequestOutput

__all__ = ["Completion", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
