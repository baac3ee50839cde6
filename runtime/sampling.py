"""Device samplers: greedy argmax, and per-row temperature / min-p / top-k / top-p draws.

Every function here is pure and jittable with static shapes (R rows, V vocab);
the engine jits them once at start (or fuses them into the step) and the token
ids stay on the device. A row's randomness is a Gumbel vector drawn from
`fold_in(key(seed), position)` and indexed by token id, so a request replays the
same tokens whatever batch, row, bucket or filter path it lands in.

Ties resolve to the lower token id everywhere: argmax, the top-k cut (exactly k
tokens are kept; among equal logits at the k-th place the lower ids win) and the
nucleus cut (tokens are ranked by descending logit, then ascending id).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glint.pallas_kernels import tuning
from glint.runtime.params import SEED_LIMIT, SamplingParams

_POSITION_LIMIT = 2**31  # positions are int32 on the device
_INT32_MAX = 2**31 - 1


# SamplerInputs' per-row arrays with their dtypes, in the order the programs take them (programs.StepLayout, the
# `sample` program)
SAMPLER_COLUMNS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("min_p", np.float32),
                   ("seed", np.uint32), ("position", np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerInputs:
    """Per-row sampling controls for one step; a pytree of [R] arrays.

    temperature: f32[R]; <= 0 makes the row greedy.
    top_k: i32[R]; 0 (or >= V) keeps every token.
    top_p: f32[R]; in (0, 1], 1 keeps every token.
    min_p: f32[R]; in [0, 1], 0 keeps every token.
    seed: u32[R]; the request's seed.
    position: i32[R]; position of the token being sampled (the key is
      `fold_in(key(seed), position)`).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    position: jax.Array

    def columns(self) -> tuple:
        """The arrays in `SAMPLER_COLUMNS`' order: the programs' argument convention."""
        return tuple(getattr(self, name) for name, _ in SAMPLER_COLUMNS)

    @classmethod
    def from_columns(cls, values) -> SamplerInputs:
        """The inverse of `columns`."""
        return cls(**{name: value for (name, _), value in zip(SAMPLER_COLUMNS, values, strict=True)})

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        positions: Sequence[int],
        rows: int,
        seeds: Sequence[int] | None = None,
    ) -> SamplerInputs:
        """Builds host-side (NumPy) inputs for `len(params_list)` rows, padded to `rows`.

        Row i samples the token at `positions[i]` under `params_list[i]`. Padding
        rows are greedy (their tokens are garbage the caller drops). Seeds must be
        concrete: a request created with `seed=None` needs a seed drawn by the
        caller, passed through `seeds` (which, when given, overrides every
        `params.seed`; also the place to give each of n > 1 completions of one
        request its own stream). Only greedy rows may go without a seed.
        """
        num_used = len(params_list)
        if num_used > rows:
            raise ValueError(f"{num_used} requests do not fit in rows={rows}")
        if len(positions) != num_used:
            raise ValueError(f"got {len(positions)} positions for {num_used} requests")
        if seeds is not None and len(seeds) != num_used:
            raise ValueError(f"got {len(seeds)} seeds for {num_used} requests")
        row_seeds = [p.seed for p in params_list] if seeds is None else list(seeds)
        if None in row_seeds:
            for i, params in enumerate(params_list):
                if row_seeds[i] is None:
                    if not params.is_greedy:
                        raise ValueError(
                            f"row {i} samples (temperature={params.temperature}) but has no "
                            "seed: draw one for seed=None requests and pass it in seeds"
                        )
                    row_seeds[i] = 0
        for name, values, limit in (("seed", row_seeds, SEED_LIMIT), ("position", positions, _POSITION_LIMIT)):
            as_float = np.asarray(values, np.float64)  # one compare for all rows; NaN fails it too
            bad = np.flatnonzero(~((as_float >= 0) & (as_float < limit)))
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"row {i}: {name} must be in [0, 2**{limit.bit_length() - 1}), got {values[i]!r}")

        temperature = _column([p.temperature for p in params_list], np.float32, 0.0, rows)
        top_k = [p.top_k for p in params_list]
        if top_k and max(top_k) > _INT32_MAX:  # as good as keeping every token
            top_k = [min(k, _INT32_MAX) for k in top_k]
        top_k = _column(top_k, np.int32, 0, rows)
        top_p = _column([p.top_p for p in params_list], np.float32, 1.0, rows)
        min_p = _column([p.min_p for p in params_list], np.float32, 0.0, rows)
        seed = _column(row_seeds, np.uint32, 0, rows)
        position = _column(positions, np.int32, 0, rows)
        return cls(temperature, top_k, top_p, min_p, seed, position)


def _column(values: Sequence, dtype, pad, rows: int) -> np.ndarray:
    """`values` as a [rows] array, `pad` after them."""
    out = np.full(rows, pad, dtype)
    out[:len(values)] = values
    return out


def uses_filters(params_list: Sequence[SamplingParams]) -> bool:
    """Host-side: whether any sampled (non-greedy) request sets top_k or top_p, the filters that rank the
    vocabulary. When False, `sample(..., is_filtered=False)` skips the per-row sort; min_p needs none (only each
    row's largest logit), so both paths apply it.
    """
    return any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1) for p in params_list)


HISTORY_PAD = 2**31 - 1  # a history entry past the row's tokens: out of any vocabulary, so it counts nowhere
# A step's histories are as wide as its longest (prompt + completion so far) rounded up to one of these widths, each
# a program of its own: 256 tokens, times 4 each, up to the context capacity (the last width).
HISTORY_WIDTH_MIN, HISTORY_WIDTH_STEP = 256, 4


def history_widths(capacity: int) -> tuple[int, ...]:
    """The widths a step's histories may take: HISTORY_WIDTH_MIN times powers of HISTORY_WIDTH_STEP below
    `capacity`, then `capacity`."""
    widths, width = [], HISTORY_WIDTH_MIN
    while width < capacity:
        widths.append(width)
        width *= HISTORY_WIDTH_STEP
    return (*widths, capacity)


# Tokens a row may name on the device: its logit_bias (at most params.MAX_LOGIT_BIAS), its allowed_token_ids and,
# below min_tokens, its stop tokens' bans; padding entries are HISTORY_PAD ids, dropped.
BIAS_WIDTH = 512


def logit_entries(params: SamplingParams, banned: Sequence[int] = ()) -> dict[int, float]:
    """{token: bias} a row names on the device (at most BIAS_WIDTH): its allowed tokens (0), its logit_bias, and
    `banned` (-inf: a ban outranks a bias)."""
    entries = dict.fromkeys(params.allowed_token_ids or (), 0.0)
    entries.update(params.logit_bias)
    entries.update(dict.fromkeys(banned, -np.inf))
    return entries


@dataclasses.dataclass(frozen=True)
class PenaltyInputs:
    """Per sampled row: the tokens its penalties look at and their strengths (host numpy arrays, R rows).

    history: i32[R, W]; the row's prompt then its completion so far, HISTORY_PAD after; an entry < 0 is a token
      the previous step drew, still on the device: its row -(entry + 1) of that step's output. W: the first of
      `history_widths(capacity)` that holds the longest row.
    prompt_len: i32[R]; the history's first prompt_len entries are the prompt.
    presence, frequency, repetition: f32[R]; padding rows 0, 0, 1 (off).
    bias_ids: i32[R, BIAS_WIDTH]; the tokens whose logits `bias` f32[R, BIAS_WIDTH] shifts (-inf: banned), each
      at most once a row; HISTORY_PAD after.
    allowed: bool[R, BIAS_WIDTH]; the entries of bias_ids that a `restricted` (bool[R]) row may draw: its
      allowed_token_ids, the only tokens it may draw.
    """

    history: np.ndarray
    prompt_len: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    bias_ids: np.ndarray
    bias: np.ndarray
    allowed: np.ndarray
    restricted: np.ndarray

    def columns(self) -> tuple:
        return (self.history, self.prompt_len, self.presence, self.frequency, self.repetition, self.bias_ids,
                self.bias, self.allowed, self.restricted)

    @classmethod
    def from_rows(cls, histories: Sequence[tuple[Sequence[int], Sequence[int]]],
                  params_list: Sequence[SamplingParams], rows: int, capacity: int,
                  banned: Sequence[Sequence[int]] | None = None) -> PenaltyInputs:
        """One (prompt, completion so far) and params per sampled row, padded to `rows` rows of the first width
        of `history_widths(capacity)` that holds the longest. A prompt may be an i32 array (copied as a block: a long
        prompt is the bulk of a history).
        banned: per row, tokens it may not draw (a request below its min_tokens: its stop tokens), else none."""
        if not len(histories) == len(params_list) <= rows or (banned is not None and len(banned) != len(histories)):
            raise ValueError(f"{len(histories)} histories, {len(params_list)} params and "
                             f"{'no' if banned is None else len(banned)} bans for at most {rows} rows")
        longest = max((len(prompt) + len(completion) for prompt, completion in histories), default=0)
        width = next((w for w in history_widths(capacity) if w >= longest), capacity)
        history = np.full((rows, width), HISTORY_PAD, np.int32)
        for i, (prompt, completion) in enumerate(histories):
            n, total = len(prompt), len(prompt) + len(completion)
            if total > capacity:
                raise ValueError(f"row {i}: {total} tokens exceed the capacity {capacity}")
            history[i, :n] = prompt
            history[i, n:total] = completion
        bias_ids = np.full((rows, BIAS_WIDTH), HISTORY_PAD, np.int32)
        bias = np.zeros((rows, BIAS_WIDTH), np.float32)
        allowed = np.zeros((rows, BIAS_WIDTH), bool)
        for i, p in enumerate(params_list):
            entries = logit_entries(p, () if banned is None else banned[i])
            if len(entries) > BIAS_WIDTH:
                raise ValueError(f"row {i}: {len(entries)} logit biases, allowed tokens and bans exceed {BIAS_WIDTH}")
            bias_ids[i, :len(entries)] = list(entries)
            bias[i, :len(entries)] = list(entries.values())
            if p.allowed_token_ids is not None:
                allowed[i, :len(entries)] = np.isin(bias_ids[i, :len(entries)], p.allowed_token_ids)
        return cls(history, _column([len(prompt) for prompt, _ in histories], np.int32, 0, rows),
                   _column([p.presence_penalty for p in params_list], np.float32, 0.0, rows),
                   _column([p.frequency_penalty for p in params_list], np.float32, 0.0, rows),
                   _column([p.repetition_penalty for p in params_list], np.float32, 1.0, rows), bias_ids, bias,
                   allowed, _column([p.allowed_token_ids is not None for p in params_list], bool, False, rows))


def penalize(logits: jax.Array, history: jax.Array, prompt_len: jax.Array, presence: jax.Array,
             frequency: jax.Array, repetition: jax.Array, bias_ids: jax.Array, bias: jax.Array, allowed: jax.Array,
             restricted: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """The logits with each row's restriction, biases and penalties applied (`PenaltyInputs`'s columns;
    prev_tokens i32[R]: the previous step's output, which the history's negative entries index), as vLLM applies
    them: a restricted row's tokens outside its allowed ones become -inf, and the biases are added; then a token in
    the prompt or the completion has its logit divided by `repetition` if positive, else multiplied; then
    `frequency` times its count in the completion and `presence` if it occurs there at all are subtracted.
    -> f32[R, V]."""
    num_rows, vocab_size = logits.shape
    entry_rows = lax.broadcasted_iota(jnp.int32, bias_ids.shape, 0)
    kept = jnp.zeros((num_rows, vocab_size), bool).at[entry_rows, bias_ids].set(allowed, mode="drop")
    logits = jnp.where(restricted[:, None] & ~kept, -jnp.inf, logits.astype(jnp.float32))
    logits = logits.at[entry_rows, bias_ids].add(bias, mode="drop")
    rows_of_prev = jnp.clip(-history - 1, 0, prev_tokens.shape[0] - 1)
    tokens = jnp.where(history >= 0, history, prev_tokens[rows_of_prev])
    in_completion = lax.broadcasted_iota(jnp.int32, history.shape, 1) >= prompt_len[:, None]
    rows = lax.broadcasted_iota(jnp.int32, history.shape, 0)
    counts = jnp.zeros((num_rows, vocab_size), jnp.int32).at[rows, tokens].add(in_completion.astype(jnp.int32),
                                                                                   mode="drop")
    seen = jnp.zeros((num_rows, vocab_size), bool).at[rows, tokens].set(True, mode="drop")
    repetition = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def sample_argmax(logits: jax.Array) -> jax.Array:
    """Greedy tokens: logits f32/bf16[R, V] -> i32[R]; ties go to the lower id."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {logits.shape}")
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _gumbel_noise(seed: jax.Array, position: jax.Array, vocab_size: int) -> jax.Array:
    """u32[R], i32[R] -> f32[R, V]: each row's noise depends only on its (seed, position)."""

    def row_noise(row_seed: jax.Array, row_position: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(row_seed), row_position)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row_noise)(seed, position)


def _min_p_mask(scaled: jax.Array, largest: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop p_i < min_p * p_max, in logits (softmax's normaliser cancels), as vLLM masks: the most likely token
    always stays, and a NaN compares False, so min_p 0 keeps every token as no filter would.
    scaled: f32[R, V]; largest: f32[R, 1], each row's largest; min_p: f32[R] -> bool[R, V]."""
    return ~(scaled < largest + jnp.log(min_p)[:, None])


def _filter_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The tokens each row keeps: those at least min_p times as likely as its most likely token and among its
    top-k (both cut the ranking at a place, so their order does not matter), then of those its top-p nucleus.
    tuning.SAMPLING_FILTER picks how the ranking is cut: "keys" sorts only each row's logits' sort keys, "sort" its
    (logit, id) pairs: the same tokens but where float32 rounding of the nucleus' mass decides (on a GPU the two
    programs may sum it in other orders).

    scaled: f32[R, V] (temperature applied); top_k: i32[R]; top_p, min_p: f32[R] -> bool[R, V], by token id.
    """
    if tuning.SAMPLING_FILTER not in ("sort", "keys"):
        raise ValueError(f"tuning.SAMPLING_FILTER must be 'sort' or 'keys', got {tuning.SAMPLING_FILTER!r}")
    vocab_size = scaled.shape[1]
    k = jnp.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    if tuning.SAMPLING_FILTER == "keys":
        return _keys_filter_mask(scaled, k, top_p, min_p)
    token_ids = lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    # One stable ascending sort of -logits per row: descending logits, ties by
    # ascending id. Negation is exact, so sorted values equal the scaled ones.
    neg_sorted, order = lax.sort((-scaled, token_ids), dimension=1, num_keys=1, is_stable=True)
    rank = token_ids  # rank j of sorted column j
    keep = rank < k[:, None]
    keep &= _min_p_mask(-neg_sorted, -neg_sorted[:, :1], min_p)
    probs = jax.nn.softmax(jnp.where(keep, -neg_sorted, -jnp.inf), axis=-1)
    keep &= rank < _nucleus_size(probs, top_p)[:, None]
    rows = lax.broadcasted_iota(jnp.int32, scaled.shape, 0)
    return jnp.zeros(scaled.shape, bool).at[rows, order].set(keep, unique_indices=True)


def _nucleus_size(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """i32[R]: how many of each row's ranked tokens its top-p nucleus keeps, from their probabilities in rank order
    f32[R, V]: those whose mass ranked strictly above is < top_p, the smallest prefix reaching top_p, counted (so a
    prefix even where float32 sums dip), at least one; top_p >= 1 keeps all, whatever the rounding."""
    mass_above = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))
    size = jnp.maximum(jnp.sum(mass_above < top_p[:, None], axis=1), 1)
    return jnp.where(top_p >= 1, probs.shape[1], size)


def _keys_filter_mask(scaled: jax.Array, k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """`_filter_mask` from a sort of each row's sort keys alone (XLA's GPU compiler sorts u32 keys with CUB's radix
    sort, 4 bytes an entry against 12 for (logit, id) pairs): the same ranked values, masks and nucleus sums, so
    the same tokens. The top-k and the nucleus each keep a prefix of the ranking; the kept prefix maps back to token
    ids by the key of its last token and, among tokens of that key, by id. k: i32[R] in [1, V]."""
    sort_keys = _sort_keys(-scaled)  # ascending: descending logits, NaN last (lax.sort's order)
    ranked = lax.sort(sort_keys, dimension=1, is_stable=False)  # keys alone: ties need no order
    neg_sorted = _from_sort_keys(ranked)
    largest = -neg_sorted[:, :1]
    in_top_k = lax.broadcasted_iota(jnp.int32, scaled.shape, 1) < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k & _min_p_mask(-neg_sorted, largest, min_p), -neg_sorted, -jnp.inf),
                           axis=-1)
    prefix = jnp.minimum(k, _nucleus_size(probs, top_p))
    last = jnp.take_along_axis(ranked, prefix[:, None] - 1, axis=1)  # [R, 1]
    of_last = sort_keys == last
    ahead = jnp.sum(sort_keys < last, axis=1, keepdims=True)
    in_prefix = (sort_keys < last) | (of_last & (jnp.cumsum(of_last, axis=1) <= prefix[:, None] - ahead))
    return in_prefix & _min_p_mask(scaled, largest, min_p)  # min_p by value: a prefix but for NaNs, which it keeps


def _from_sort_keys(keys: jax.Array) -> jax.Array:
    """The float32 values of `_sort_keys` keys."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32((1 << 31) - 1), ~keys)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _sort_keys(x: jax.Array) -> jax.Array:
    """u32 keys in the order lax.sort gives float32 x: -0.0 equal to 0.0, every NaN after +inf."""
    x = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), jnp.where(x == 0, jnp.float32(0), x))
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def sample(logits: jax.Array, inputs: SamplerInputs, *, is_filtered: bool = True) -> jax.Array:
    """Samples one token per row.

    logits: f32/bf16[R, V]. inputs: `SamplerInputs` of [R] arrays.
    is_filtered (static): False promises that no sampled row sets top_k / top_p (see `uses_filters`)
      and skips the [R, V] sort (min_p, which needs none, applies either way); rows then get the very
      tokens the filtered path would give them, so it is purely a speed switch.
    Returns i32[R]: argmax for rows with temperature <= 0; otherwise a draw from
    softmax(logits / temperature) (in float32) restricted to the tokens min_p keeps and the top_k tokens, then
    to the top_p nucleus, with the key `fold_in(key(seed), position)`.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [R, V], got shape {logits.shape}")
    num_rows, vocab_size = logits.shape
    for field in dataclasses.fields(inputs):
        shape = getattr(inputs, field.name).shape
        if shape != (num_rows,):
            raise ValueError(f"inputs.{field.name} has shape {shape}, logits need ({num_rows},)")
    is_sampled = inputs.temperature > 0
    temperature = jnp.where(is_sampled, inputs.temperature, 1.0).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    perturbed = scaled + _gumbel_noise(inputs.seed.astype(jnp.uint32), inputs.position, vocab_size)
    greedy = sample_argmax(logits)
    if is_filtered:
        keep = _filter_mask(scaled, inputs.top_k, inputs.top_p, inputs.min_p)
    else:  # the row's largest scaled logit is at its argmax (dividing by temperature > 0 keeps the order): no pass
        keep = _min_p_mask(scaled, jnp.take_along_axis(scaled, greedy[:, None], axis=1), inputs.min_p)
    # noise is looked up by token id, so a row draws the same token on either path
    perturbed = jnp.where(keep, perturbed, -jnp.inf)
    return jnp.where(is_sampled, jnp.argmax(perturbed, axis=-1).astype(jnp.int32), greedy)


class Logprobs(NamedTuple):
    """Log-probabilities under the raw model distribution (before temperature/filters)."""

    token: jax.Array  # f32[R]: of the chosen token
    top: jax.Array  # f32[R, k]: the k best, descending
    top_ids: jax.Array  # i32[R, k]: their ids; ties to the lower id


def logprobs(logits: jax.Array, token_ids: jax.Array, k: int) -> Logprobs:
    """Log-softmax (float32) of each row's chosen token and its top-k alternatives.

    logits: f32/bf16[R, V]; token_ids: i32[R]; k (static): 0 <= k <= V.
    """
    if logits.ndim != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"need logits [R, V] and token_ids [R], got {logits.shape} and {token_ids.shape}"
        )
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in [0, {logits.shape[1]}], got {k}")
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.take_along_axis(log_probs, token_ids.astype(jnp.int32)[:, None], axis=1)[:, 0]
    top, top_ids = lax.top_k(log_probs, k)
    return Logprobs(token, top, top_ids.astype(jnp.int32))
