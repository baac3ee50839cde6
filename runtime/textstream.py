"""Token ids in, text out: whole characters only, and stop strings matched across token boundaries.

One `TextStream` per completion. Text comes from the tokenizer's streaming decoder (`tokenizers`'
DecodeStream), which never splits a multi-byte character; text that could still be the start of a stop
string is held back until the next tokens tell. `glint generate` and `glint serve` both stream through it.
"""
from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """`push(token_ids)` -> the text that is safe to show now; `finish()` -> the text held back at the end.

    After a stop string appears, `stopped` is True, the text before it has been returned, and the stop string and
    everything after it are dropped; `num_tokens` counts the tokens pushed up to and including the one that
    completed the stop string. With `min_tokens` (SamplingParams'), a stop string counts only where it ends in the
    text of a token after the first min_tokens (vLLM's). With `include_stop`, the text ends with the stop string,
    not before it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0,
                 include_stop: bool = False):
        from tokenizers.decoders import DecodeStream

        if isinstance(stop, str):
            stop = (stop,)
        self.stop = tuple(s for s in stop if s)
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self._held = ""  # decoded, not yet returned: it may begin a stop string
        self._ids: list[int] = []
        self._returned = 0  # characters returned so far
        self.stopped = False
        self.num_tokens = 0
        self._min_tokens = min_tokens
        self._include_stop = include_stop

    @classmethod
    def for_params(cls, tokenizer, params) -> TextStream:
        """The stream a request's `SamplingParams` ask for: its stop strings, min_tokens and text options."""
        return cls(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                   min_tokens=params.min_tokens, include_stop=params.include_stop_str_in_output)

    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for token in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            self._ids.append(int(token))
            piece = self._decoder.step(self._tokenizer, int(token))
            if not piece:
                continue
            self._held += piece
            if self.num_tokens <= self._min_tokens:
                # vLLM's min_tokens: a stop string counts only where it ends in the text of a later token, so of
                # this text only the start of one is held
                out.append(self._release())
            elif (cut := self._cut(self._held)) is not None:
                out.append(self._held[:cut])
                self._held, self.stopped = "", True
        if not self.stopped:
            out.append(self._release())
        text = "".join(out)
        self._returned += len(text)
        return text

    def finish(self) -> str:
        """The rest of the text once no token follows: what was held for a possible stop string, and bytes the
        decoder kept for a character never completed (as the whole decode shows them), up to a stop string."""
        rest, stopped = self.rest()
        self._held, self.stopped = "", stopped
        self._returned += len(rest)
        return rest

    def rest(self) -> tuple[str, bool]:
        """What `finish()` would return, and whether a stop string ends it; changes nothing."""
        if self.stopped:
            return "", True
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        rest = full[self._returned:]
        cut = self._cut(rest)
        return (rest, False) if cut is None else (rest[:cut], True)

    def _cut(self, text: str) -> int | None:
        """Where `text` ends at its first stop string (before it, or after it with `include_stop`; of stop strings
        that start at the same place, the longest), or None."""
        hits = [(i, len(s)) for i, s in ((text.find(s), s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        first = min(i for i, _ in hits)
        return first + max(n for i, n in hits if i == first) if self._include_stop else first

    def _release(self) -> str:
        """The held text but its longest end that may begin a stop string (which stays held)."""
        keep = self._stop_prefix_len()
        text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return text

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the held text that is a proper start of some stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(self._held)), 0, -1)
                    if self._held.endswith(s[:k])), default=0)
