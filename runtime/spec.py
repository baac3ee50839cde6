"""Speculative decoding: drafters that propose tokens, and the lossless rule that accepts them.

A speculating sequence feeds a block `[t0, d1 .. dk]` (its last token, then k draft tokens) in one step and
gets the target's distribution at every block position. Row i of the block verifies d(i+1): greedy rows
accept it when it is the target's argmax; sampled rows accept it with probability p(d) (every drafter here
proposes deterministically, so q is a point mass and min(1, p/q) is p(d)) and otherwise draw from the
residual, p without d, renormalised. The first rejected row's draw, or after k acceptances the last row's
draw, is the target's own token: so a sequence commits accepted + 1 tokens per step and its tokens have
exactly the target's distribution (greedy: exactly the target's greedy tokens).

Host drafters (`NgramDrafter`, `OracleDrafter`) propose from the tokens the host has; the DFlash drafter
runs on the device (`glint.model.dflash`, programs in `glint.runtime.step`).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glint.runtime.sampling import SamplerInputs, _gumbel_noise, _scaled, filter_mask, sample_argmax

DRAFT_KINDS = ("ngram", "oracle")  # besides a DFlash checkpoint folder
DRAFTED_ON_DEVICE = -2  # a proposal the device drafter makes in the step itself (the host never sees it)


def accept(logits, sampler: SamplerInputs, proposed, *, is_filtered: bool):
    """Per row: the token the target commits there and whether it accepts the row's proposal.

    logits f32[R, V]; proposed i32[R]: the draft token row r verifies (the block's next token), -1 for a
    row that only samples (a block's last row, an ordinary decode or prefill row).
    -> (tokens i32[R], accepted bool[R]): an accepted row's token is its proposal; a rejected row's is a
    draw from the residual; a row with no proposal draws as `sample` does (the same token for the same
    seed and position). Randomness: the sampler's Gumbel noise for the draws and an independent uniform
    from `fold_in(fold_in(key(seed), position), 1)` for the acceptance test.
    """
    vocab_size = logits.shape[1]
    is_sampled, scaled = _scaled(logits, sampler)
    has = proposed >= 0
    safe = jnp.maximum(proposed, 0)
    greedy = sample_argmax(logits)
    greedy_accepted = has & (greedy == safe)

    def sampled():
        keep = filter_mask(scaled, sampler.top_k, sampler.top_p) if is_filtered else jnp.ones(scaled.shape, bool)
        masked = jnp.where(keep, scaled, -jnp.inf)
        p_proposed = jnp.take_along_axis(jax.nn.softmax(masked, axis=-1), safe[:, None], axis=1)[:, 0]
        seeds = sampler.seed.astype(jnp.uint32)
        u = jax.vmap(lambda s, p: jax.random.uniform(
            jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), 1)))(seeds, sampler.position)
        accepted = jnp.where(is_sampled, has & (u < p_proposed), greedy_accepted)
        # The residual excludes the rejected proposal; a row without one draws from p itself.
        ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
        residual = jnp.where(has[:, None] & (ids == safe[:, None]), -jnp.inf, masked)
        perturbed = residual + _gumbel_noise(seeds, sampler.position, vocab_size)
        drawn = jnp.where(is_sampled, jnp.argmax(perturbed, axis=-1).astype(jnp.int32), greedy)
        return jnp.where(accepted, safe, drawn), accepted

    # All-greedy verification (the usual case) skips the [R, V] noise, softmax and sort.
    return jax.lax.cond(jnp.any(is_sampled), sampled,
                        lambda: (jnp.where(greedy_accepted, safe, greedy), greedy_accepted))


def committed(tokens: np.ndarray, accepted: np.ndarray, row: int, length: int) -> list[int]:
    """The tokens a block of `length` rows from `row` commits: its accepted proposals, then the target's token."""
    out = []
    for i in range(row, row + length):
        out.append(int(tokens[i]))
        if not accepted[i]:
            break
    return out


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from `max_n` down to `min_n`; the first n with a match wins), as vLLM's ngram proposer does."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.num_speculative_tokens, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> list[int]:
        arr = np.asarray(tokens, np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # each start but the tail itself
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []


class OracleDrafter:
    """Replays known continuations (e.g. a plain greedy run's output) of given prompts: the acceptance
    ceiling, for benchmarks. A prompt it was not given gets no proposals."""

    def __init__(self, num_speculative_tokens: int, continuations: dict | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        for prompt, tokens in (continuations or {}).items():
            self.record(prompt, tokens)

    def record(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        self.continuations[tuple(int(t) for t in prompt)] = [int(t) for t in continuation]

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> list[int]:
        known = self.continuations.get(tuple(tokens[:prompt_len]))
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

    def propose(self, tokens: Sequence[int], prompt_len: int, k: int) -> list[int]:
        return [DRAFTED_ON_DEVICE] * k if k == self.num_speculative_tokens else []


def host_drafter(kind: str, num_speculative_tokens: int):
    if kind == "ngram":
        return NgramDrafter(num_speculative_tokens)
    if kind == "oracle":
        return OracleDrafter(num_speculative_tokens)
    raise ValueError(f"draft {kind!r} is not a drafter kind {DRAFT_KINDS} nor a DFlash checkpoint folder")
