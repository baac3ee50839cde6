"""Request lifecycle: a small dataclass per sequence plus a status enum, and the outputs users see."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from glint.runtime.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not holding a sequence (new, or preempted for recompute)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated: prompt + generated tokens, of which the cache holds `num_cached`."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    num_children: int = 0  # n > 1: how many siblings to clone off once the prompt is prefilled
    generated: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    status: Status = Status.WAITING
    seq: int | None = None
    num_cached: int = 0
    finish_reason: str | None = None
    num_read: int = 0  # tokens `Engine.new_tokens` has handed out
    acceptance_lengths: list[int] = field(default_factory=list)  # per speculative step: accepted drafts + 1
    page_keys: list[bytes] = field(default_factory=list)  # prefix cache: keys of the known tokens' full pages
    # With stop strings: (the TextStream its tokens went through (None before the first and once finished),
    # tokens pushed, the text shown so far) as one value, so that an interrupt cannot leave one part updated
    # without the others. The text held back is what may begin a stop string.
    stop_state: tuple = (None, 0, "")
    _prompt_array: np.ndarray | None = field(default=None, init=False, repr=False)

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt as i32[len(prompt)], made once (penalties upload it every step)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt, np.int32)
        return self._prompt_array

    @property
    def num_known(self) -> int:
        """How many generated tokens the host has the values of: the steps still in flight leave placeholders
        (negative) at the end, one each, so this looks at those only, not at every token."""
        n = len(self.generated)
        while n and self.generated[n - 1] < 0:
            n -= 1
        return n

    @property
    def known_tokens(self) -> list[int]:
        """Generated tokens whose values the host has."""
        n = self.num_known
        return self.generated if n == len(self.generated) else self.generated[:n]

    def token_slice(self, start: int, count: int) -> list[int]:
        """tokens[start:start + count] without building prompt + generated."""
        n = len(self.prompt)
        if start >= n:
            return self.generated[start - n:start - n + count]
        return self.prompt[start:start + count] + self.generated[:max(0, start + count - n)]

    @property
    def num_pending(self) -> int:
        """Known tokens not yet in the cache; feeding all of them yields the next token's logits."""
        return len(self.prompt) + len(self.generated) - self.num_cached


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    logprobs: list[dict[int, float]] | None = None
    acceptance_lengths: list[int] | None = None  # speculative decoding: per step, accepted draft tokens + 1


@dataclass
class RequestOutput:
    """What `generate` returns per prompt; `token_ids`, `finish_reason`, `text` are the first completion's."""

    rid: int
    prompt_token_ids: list[int]
    outputs: list[Completion]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def acceptance_lengths(self) -> list[int] | None:
        return self.outputs[0].acceptance_lengths
