"""Engine configuration."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION_IMPLS = ("auto", "pallas", "reference", "interpret")
# The KV pools' element type: "auto" is the model's dtype; "fp8" (float8_e4m3fn with a float32 scale per row and
# head, kvcache/state.py) takes 0.52x a bf16 cache's bytes at head_dim 128 (0.53x at 64).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}
WINDOWED_PREFILL_CHUNK = 512  # the default max_prefill_chunk of models with sliding-window layers


DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and where the KV cache lives.

    `forward_sizes` are the narrow step widths (default: DEFAULT_FORWARD_SIZES up to `max_step_tokens`); wider
    steps get power-of-two buckets up to `max_step_tokens`. `capacity` is the most positions a sequence may hold
    (default: the model's context, capped at 32768; beyond the model's context only with `allow_long_context`).
    `num_pages` defaults to `memory_fraction` of free device memory.
    """

    max_seqs: int = 64
    page_size: int = 16
    max_step_tokens: int = 4096
    forward_sizes: tuple[int, ...] | None = None
    max_sample_rows: int | None = None  # rows of logits a step returns; default max_seqs x speculative block
    min_prefill_chunk: int = 16
    # Most prompt tokens one sequence feeds per step. Sliding-window layers keep window + this - 1 rows per
    # sequence (a ring), so the default is 512 for models that have them, max_step_tokens otherwise.
    max_prefill_chunk: int | None = None
    num_pages: int | None = None
    memory_fraction: float = 0.9
    capacity: int | None = None
    attention: str = "auto"
    seed: int | None = None  # seeds of requests that give none: None draws them from the OS
    allow_long_context: bool = False  # let capacity exceed the model's max_position_embeddings
    # Batch invariance: every step runs at one width, forward_sizes[-1] (prompts go in chunks of it), so a
    # request's arithmetic is the same program's whatever shares its steps: bit-identical solo or batched.
    deterministic: bool = False
    compile_cache: bool = True  # JAX's persistent compilation cache in $GLINT_CACHE_DIR (~/.cache/glint)
    # Automatic prefix caching: a request maps the cached pages of its prompt's longest cached prefix.
    prefix_cache: bool = True
    # Speculative decoding: draft tokens a decoding sequence verifies per step (0: none; needs a drafter).
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Devices the model is split over (model/tp.py): heads, MLP columns and vocabulary 1/N each, the KV pools by
    # KV head; the first N local devices.
    tensor_parallel: int = 1
    # Launch each step's programs from a thread of their own (launcher.Launcher), so the host's scheduling and
    # postprocessing overlap XLA's launch; False: launch in step() itself.
    async_launch: bool = True

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        if self.max_sample_rows is None:  # every running sequence can sample (verify its whole block) in one step
            object.__setattr__(self, "max_sample_rows", self.max_seqs * (1 + k))
        sizes = self.forward_sizes
        if sizes is None:  # the defaults a smaller max_step_tokens leaves (a wrong one is refused below)
            top = self.max_step_tokens if isinstance(self.max_step_tokens, int) else 0
            sizes = [w for w in DEFAULT_FORWARD_SIZES if w <= top]
        object.__setattr__(self, "forward_sizes", tuple(sorted(set(int(w) for w in sizes))))
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.deterministic and self.forward_sizes:  # one width: the widest narrow one
            object.__setattr__(self, "forward_sizes", self.forward_sizes[-1:])
            object.__setattr__(self, "max_step_tokens", self.forward_sizes[-1])
        for name in ("max_seqs", "page_size", "max_step_tokens", "max_sample_rows", "min_prefill_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.forward_sizes or self.forward_sizes[0] < 1:
            raise ValueError(f"forward_sizes must be positive, got {self.forward_sizes}")
        if self.forward_sizes[-1] > self.max_step_tokens:
            raise ValueError(f"forward_sizes {self.forward_sizes} exceed max_step_tokens {self.max_step_tokens}")
        why = " (deterministic runs every step at the widest forward size)" if self.deterministic else ""
        if self.min_prefill_chunk > self.max_step_tokens:
            raise ValueError(f"min_prefill_chunk {self.min_prefill_chunk} exceeds max_step_tokens "
                             f"{self.max_step_tokens}{why}")
        chunk = self.max_prefill_chunk
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                                  or not self.min_prefill_chunk <= chunk <= self.max_step_tokens):
            raise ValueError(f"max_prefill_chunk must be an int in [min_prefill_chunk {self.min_prefill_chunk}, "
                             f"max_step_tokens {self.max_step_tokens}], got {chunk!r}{why}")
        if k + 1 > min(self.max_step_tokens, self.max_prefill_chunk or self.max_step_tokens):
            raise ValueError(f"num_speculative_tokens {k} makes blocks of {k + 1} tokens, more than one sequence may "
                             f"feed per step (max_step_tokens {self.max_step_tokens}, max_prefill_chunk "
                             f"{self.max_prefill_chunk})")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {self.num_pages}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        for name in ("compile_cache", "prefix_cache", "async_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_IMPLS}")
        n = self.tensor_parallel
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor_parallel must be a positive int, got {n!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {tuple(KV_CACHE_DTYPES)}")

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV pools' dtype for a model computing in `model_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def for_model(self, windows, capacity: int | None = None) -> EngineConfig:
        """This config with max_prefill_chunk resolved for a model whose layers have these windows, serving
        `capacity` positions: the windowed default only where it shrinks a ring (capacity > window + chunk - 1)."""
        if self.max_prefill_chunk is not None:
            return self
        shrinks = any(w and (capacity is None or capacity > w + WINDOWED_PREFILL_CHUNK - 1) for w in windows)
        chunk = max(min(WINDOWED_PREFILL_CHUNK, self.max_step_tokens), self.min_prefill_chunk) if shrinks \
            else self.max_step_tokens
        return dataclasses.replace(self, max_prefill_chunk=chunk)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Every step width, ascending: forward_sizes, then powers of two up to max_step_tokens."""
        wide, w = [], 2 * self.forward_sizes[-1]
        while w < self.max_step_tokens:
            wide.append(w)
            w *= 2
        return tuple(sorted(set(self.forward_sizes) | set(wide) | {self.max_step_tokens}))

    def bucket_for(self, num_tokens: int) -> int:
        for w in self.buckets:
            if w >= num_tokens:
                return w
        raise ValueError(f"{num_tokens} tokens exceed max_step_tokens {self.max_step_tokens}")
