"""Which tokens of which requests go into the next step (host only, no jax)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from glint.kvcache import BatchControl
from glint.runtime.config import EngineConfig
from glint.runtime.request import Request, Status


@dataclass
class Entry:
    """`count` tokens of `req` starting at its `num_cached`; `samples` rows drawn from its last token.

    A speculative block: its last known token then `draft` (count = samples = 1 + len(draft), a row per token).
    """

    req: Request
    count: int
    samples: int  # 0: a prefill chunk that does not reach the end of the known tokens
    draft: list[int] = field(default_factory=list)  # spec.DRAFTED_ON_DEVICE: drafted in the step itself


class Scheduler:
    """Continuous batching: decode tokens of running requests first, then prefill chunks, then admissions.

    An admitted request starts after the longest prefix of its tokens the prefix cache holds (all but its last
    token at most: that one's logits are needed). A step holds at most `max_step_tokens` tokens and
    `max_sample_rows` sampled rows; a prefill chunk
    is at least `min_prefill_chunk` tokens unless less of the prompt is left, and at most
    `max_prefill_chunk` (resolved by `EngineConfig.for_model`). With `propose` (speculative decoding), a decoding
    request also feeds the draft tokens `propose(req, room)` gives it (at most `room`), verified in the same step.
    """

    def __init__(self, config: EngineConfig, control: BatchControl,
                 propose: Callable[[Request, int], list[int]] | None = None):
        self.config, self.control, self.propose = config, control, propose
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admitted: list[Request] = []  # by the last schedule(), in order

    def add(self, req: Request, front: bool = False) -> None:
        req.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Entry]:
        budget, rows = self.config.max_step_tokens, self.config.max_sample_rows
        entries: list[Entry] = []
        self.admitted = []
        for i, req in enumerate(self.running):
            # drafts never take the token every later running request needs to go on
            entry = self._entry(req, budget, rows, reserve=len(self.running) - i - 1)
            if entry is not None:
                entries.append(entry)
                budget, rows = budget - entry.count, rows - entry.samples
        while self.waiting and budget > 0 and len(self.running) < self.config.max_seqs:
            req = self.waiting[0]
            num_tokens = len(req.prompt) + len(req.generated)
            req.seq = self.control.seq_new(req.page_keys[:(num_tokens - 1) // self.control.config.page_size])
            if req.seq is None:
                break
            req.num_cached = self.control.pos(req.seq)
            entry = self._entry(req, budget, rows)
            if entry is None or not self.control.can_extend(req.seq, entry.count):
                self.control.seq_rm(req.seq)
                req.seq, req.num_cached = None, 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            entries.append(entry)
            budget, rows = budget - entry.count, rows - entry.samples
            self.admitted.append(req)
        return entries

    def _entry(self, req: Request, budget: int, rows: int, reserve: int = 0) -> Entry | None:
        if len(req.generated) >= req.params.max_tokens:
            return None  # its last token is still in flight
        pending = req.num_pending
        room = min(budget, rows) - reserve - 1
        if pending == 1 and not req.num_children and self.propose is not None and room > 0:
            draft = self.propose(req, room)
            if draft:
                return Entry(req, 1 + len(draft), 1 + len(draft), draft)
        count = min(pending, budget, self.config.max_prefill_chunk)
        if count < min(pending, self.config.min_prefill_chunk):
            return None
        samples = 1 + req.num_children if count == pending else 0
        if samples > rows:
            if count == 1:
                return None
            count, samples = count - 1, 0  # feed all but the last token now; sample next step
        return Entry(req, count, samples)

    def preempt(self, entries: list[Entry]) -> Request | None:
        """Free the most recently admitted running request (recomputed later); None if none is left."""
        if not self.running:
            return None
        victim = self.running.pop()
        self.control.seq_rm(victim.seq)
        victim.seq, victim.num_cached = None, 0
        entries[:] = [e for e in entries if e.req is not victim]
        self.add(victim, front=True)
        return victim

    def retire(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.control.seq_rm(req.seq)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.seq = None
        req.status = Status.FINISHED
