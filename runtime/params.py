"""Per-request sampling parameters: a small frozen dataclass that checks itself.

Frozen and hashable, so a `SamplingParams` can key caches or ride as a static jit
argument. The device never sees it: `glint.runtime.sampling.SamplerInputs`
turns a batch of them into per-row arrays.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token
SEED_LIMIT = 2**32  # seeds are uint32 on the device
MAX_STOP, MAX_STOP_CHARS = 16, 1000  # stop strings a request may give, and their length
MAX_LOGIT_BIAS, LOGIT_BIAS_LIMIT = 300, 100.0  # logit_bias entries a request may give, and |bias| at most (OpenAI's)
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127  # float32's smallest normal and largest finite


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    # bool is an int subclass, but `top_k=True` is a bug, not a request.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return int(value)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


# The fields that change the raw logits before the draw (the `penalize` program), with the values that mean "off".
LOGIT_ADJUSTMENTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": (),
                     "min_tokens": 0, "allowed_token_ids": None}


def _check_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, from a mapping or pairs; each id once."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, (tuple, list, type({}.items()))):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {pair!r}")
        token, bias = _check_int("logit_bias token id", pair[0], 0), _check_float("logit_bias", pair[1])
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias for token {token} must be in [-{LOGIT_BIAS_LIMIT:g}, "
                             f"{LOGIT_BIAS_LIMIT:g}], got {pair[1]!r}")
        if token in out:
            raise ValueError(f"logit_bias gives token {token} twice")
        out[token] = bias
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(out)}")
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    max_tokens: tokens to generate at most (>= 1).
    temperature: logits are divided by it; <= 0 (only 0 is accepted) is greedy argmax.
    top_k: keep the k most likely tokens; 0 (or -1, as in vLLM) keeps all.
    top_p: nucleus: keep the smallest set of most likely tokens whose mass is
      >= top_p (always at least one); 1 keeps all.
    min_p: keep the tokens at least min_p times as likely as the most likely one (after temperature, before
      top_k and top_p, as vLLM applies it); 0 keeps all.
    seed: uint32 seed of the request's random stream, or None to let the engine
      draw one. A token's randomness depends only on (seed, position).
    stop_token_ids: generation stops after emitting any of these.
    stop: strings that end generation where the text first contains one (needs the checkpoint's tokenizer); the
      text returned stops before it, the token ids include the one that completed it (as vLLM's).
    ignore_eos: keep generating past the model's EOS token.
    presence_penalty: subtracted from the logit of every token the completion has generated (OpenAI's), in
      [-2, 2]; 0 is off.
    frequency_penalty: subtracted once per time the completion has generated the token (OpenAI's), in [-2, 2].
    repetition_penalty: the logit of every token in the prompt or the completion is divided by it where
      positive and multiplied where negative (the CTRL paper's, as in transformers, vLLM and llama.cpp); > 0,
      1 is off. The three apply to the raw logits, before temperature and the filters, greedy rows included.
    logit_bias: (token id, bias) pairs (a dict is taken too) added to those tokens' raw logits, before the
      penalties (OpenAI's, as vLLM applies it); each bias in [-100, 100], at most MAX_LOGIT_BIAS tokens.
    min_tokens: no stop token (stop_token_ids, and EOS unless ignore_eos) is drawn, and no stop string matched,
      before the completion has this many tokens (vLLM's): the first stop token may be the next one, a stop string
      counts where it ends in the text of a later token. <= max_tokens.
    allowed_token_ids: only these tokens may be drawn (vLLM's); None: any.
    include_stop_str_in_output: the text ends with the stop string that ended it, not before it (vLLM's).
    skip_special_tokens: special tokens (BOS, EOS, chat markers) are left out of the text (vLLM's default, True).
    n: completions to sample for the prompt.
    logprobs: top alternatives to report per token with their log-probabilities
      (0 = none, at most MAX_LOGPROBS).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int = 0

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ (numpy ints -> int, lists -> tuples).
        def store(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        store("max_tokens", _check_int("max_tokens", self.max_tokens, 1))
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        store("temperature", temperature)
        store("top_k", max(_check_int("top_k", self.top_k, -1), 0))  # -1 (vLLM's "all") as 0
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        store("top_p", top_p)
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        store("min_p", min_p)
        if self.seed is not None:
            store("seed", _check_int("seed", self.seed, 0, SEED_LIMIT - 1))
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, (tuple, list)
        ):
            raise ValueError(
                f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}"
            )
        store(
            "stop_token_ids",
            tuple(_check_int("stop_token_ids entry", t, 0) for t in self.stop_token_ids),
        )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a tuple of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters, got "
                             f"{len(stop)} of up to {max(map(len, stop))}")
        store("stop", tuple(stop))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            store(name, value)
        repetition = _check_float("repetition_penalty", self.repetition_penalty)
        if not repetition > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not FLOAT32_TINY <= repetition <= FLOAT32_MAX:  # the device's float32: 0 or inf would make NaN / inf
            raise ValueError(f"repetition_penalty must be in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (float32), got "
                             f"{self.repetition_penalty!r}")
        store("repetition_penalty", repetition)
        store("logit_bias", _check_logit_bias(self.logit_bias))
        store("min_tokens", _check_int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if isinstance(allowed, (str, bytes)) or not isinstance(allowed, (tuple, list)) or not allowed:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
            store("allowed_token_ids", tuple(sorted({_check_int("allowed_token_ids entry", t, 0) for t in allowed})))
        store("n", _check_int("n", self.n, 1))
        store("logprobs", _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """True when the raw logits change before the draw: a penalty, a logit bias, min_tokens or
        allowed_token_ids."""
        return bool(self.logit_adjustments)

    @property
    def logit_adjustments(self) -> tuple[str, ...]:
        """The fields set that change the raw logits before the draw, by name."""
        return tuple(name for name, off in LOGIT_ADJUSTMENTS.items() if getattr(self, name) != off)

    def vocab_error(self, vocab_size: int) -> tuple[str, str] | None:
        """(field, message) for the first token id a field names outside [0, vocab_size), or None."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            if bad := [t for t in ids if t >= vocab_size]:
                return name, f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def is_greedy(self) -> bool:
        """True when tokens are the argmax (temperature <= 0); top_k, top_p, min_p and seed are moot."""
        return self.temperature <= 0
