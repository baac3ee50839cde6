"""Speculative decoding: drafters that propose tokens, and the lossless rule that accepts them.

A speculating sequence feeds a block `[t0, d1 .. dk]` (its last token, then k draft tokens) in one step and
gets the target's distribution at every block position. Row i of the block draws the target's token x_i
exactly as a plain step would (`glint.runtime.sampling.sample`: argmax for greedy rows, the Gumbel-max draw
of (seed, position) for sampled ones) and accepts d(i+1) when x_i equals it; the block commits x_0, x_1, ..
up to and including the first row that rejects (or its last row).

This is the standard rule min(1, p/q), else a draw from the residual, for drafts that are deterministic (q a
point mass, as every drafter here proposes): P(accept) = P(x = d) = p(d), and a rejected row's x is
distributed as p without d, renormalised. Coupling both through the plain draw makes more than the
distribution exact: every committed token is the very token a non-speculative run draws at that position
for that seed, so seeded sampling and greedy decoding give the plain run's tokens, whatever was proposed.

Host drafters (`NgramDrafter`, `OracleDrafter`) propose from the tokens the host has; the DFlash drafter
runs on the device (`glint.model.dflash`, programs in `glint.runtime.step`).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

DRAFT_KINDS = ("ngram", "oracle")  # besides a DFlash checkpoint folder
DEFAULT_SPECULATIVE_TOKENS = 4  # draft tokens per step of the host drafters unless told
DRAFTED_ON_DEVICE = -2  # a proposal the device drafter makes in the step itself (the host never sees it)


def committed(tokens: np.ndarray, proposed: np.ndarray, row: int, length: int) -> list[int]:
    """The tokens a block of `length` rows from `row` commits: each row's drawn token, up to and including the
    first row whose draw is not the proposal it verifies (`proposed[i]`, -1 for the block's last row)."""
    block = slice(row, row + length)
    rejected = np.flatnonzero(tokens[block] != proposed[block])
    return tokens[row:row + (rejected[0] + 1 if len(rejected) else length)].tolist()


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from `max_n` down to `min_n`; the first n with a match wins), as vLLM's ngram proposer does.

    Given an `owner` (the engine passes the request), the drafter keeps that sequence's tokens as an array and
    appends only the new ones each call, so a proposal is one vectorised compare over the tokens rather than a
    conversion of all of them; the array goes with its owner. The tokens given with an owner must continue
    those of its last call (a request's known tokens only grow): the array is read afresh only when they are
    fewer or end the old part with another token."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.num_speculative_tokens, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n
        self._arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> (buffer, length)

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int, owner=None) -> list[int]:
        arr = np.asarray(tokens, np.int32) if owner is None else self._append(owner, tokens)
        last = len(arr) - 1
        max_n = min(self.max_n, last)
        if max_n < self.min_n:
            return []
        ends = np.flatnonzero(arr[:last] == arr[last])  # earlier positions of the last token
        matched = np.ones(len(ends), np.int64)  # how many of the last tokens end there too (up to max_n)
        alive = np.ones(len(ends), bool)
        for t in range(1, max_n):
            alive &= ends >= t
            alive[alive] = arr[ends[alive] - t] == arr[last - t]
            matched += alive
        n = int(matched.max()) if len(ends) else 0
        if n < self.min_n:
            return []
        end = int(ends[np.flatnonzero(matched >= n)[-1]])  # the latest occurrence of the longest n-gram
        return arr[end + 1:end + 1 + k].tolist()

    def _append(self, owner, tokens: Sequence[int]) -> np.ndarray:
        """`owner`'s tokens as an array, extended by those past its last call's (see the class)."""
        buf, n = self._arrays.get(owner, (np.empty(0, np.int32), 0))
        if n > len(tokens) or (n and buf[n - 1] != tokens[n - 1]):
            n = 0
        if len(tokens) > len(buf):
            buf = np.concatenate([buf[:n], np.empty(2 * len(tokens) - n, np.int32)])
        buf[n:len(tokens)] = tokens[n:]
        self._arrays[owner] = (buf, len(tokens))
        return buf[:len(tokens)]


class OracleDrafter:
    """Replays known continuations (e.g. a plain greedy run's output) of given prompts: the acceptance
    ceiling, for benchmarks. A prompt it was not given gets no proposals. Given an `owner` (the engine passes the
    request, whose prompt does not change), the continuation is looked up once and kept with its owner until
    `record` gives any prompt a new one."""

    def __init__(self, num_speculative_tokens: int, continuations: dict | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        self._continuations: dict[tuple[int, ...], list[int]] = {}
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> its continuation
        for prompt, tokens in (continuations or {}).items():
            self.record(prompt, tokens)

    def record(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self._continuations[tuple(int(t) for t in prompt)] = [int(t) for t in continuation]
        self._known.clear()

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int, owner=None) -> list[int]:
        known = self._known.get(owner) if owner is not None else None
        if known is None:
            known = self._continuations.get(tuple(tokens[:prompt_len]))
            if owner is not None and known is not None:
                self._known[owner] = known  # a request's prompt does not change: looked up once
        if known is None:
            return []
        done = len(tokens) - prompt_len
        return known[done:done + k]


class DFlashDrafter:
    """A DFlash draft (`glint.model.dflash`) run on the device: every block is the full block_size, drafted by
    the engine's draft programs in the step that verifies it; `propose` only reserves the rows."""

    def __init__(self, cfg, params):
        self.cfg, self.params = cfg, params
        self.num_speculative_tokens = cfg.block_size - 1

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int, owner=None) -> list[int]:
        return [DRAFTED_ON_DEVICE] * k if k == self.num_speculative_tokens else []


def host_drafter(kind: str, num_speculative_tokens: int | None = None):
    """The host drafter `kind` proposing `num_speculative_tokens` (default DEFAULT_SPECULATIVE_TOKENS) per step."""
    if num_speculative_tokens is None:
        num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS
    if kind == "ngram":
        return NgramDrafter(num_speculative_tokens)
    if kind == "oracle":
        return OracleDrafter(num_speculative_tokens)
    raise ValueError(f"draft {kind!r} is not a drafter kind {DRAFT_KINDS} nor a DFlash checkpoint folder")
