"""One engine, one thread: requests arrive through a thread-safe queue, tokens go back to each caller's asyncio
queue. `glint serve` runs one `EngineWorker`; every concurrent request shares its steps.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from glint.runtime.engine import EngineFailed
from glint.runtime.params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Update:
    """What a job gained since its last update: per completion, new token ids and their logprobs (when asked), and
    why it ended (None while it runs; the list is None while all run); `done` once every completion has ended;
    `error` when it was refused or the engine failed."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    finish_reasons: list[str | None] | None = None
    done: bool = False
    error: str | None = None
    accepted: bool = False  # the first update of a request the engine took

    def merge(self, later: Update) -> Update:
        """This update followed by `later`, as one."""
        def joined(a: list[list], b: list[list]) -> list[list]:
            return [x + y for x, y in zip(a, b)] if a and b else a or b

        return Update(joined(self.tokens, later.tokens), joined(self.logprobs, later.logprobs),
                      later.finish_reasons if later.finish_reasons is not None else self.finish_reasons,
                      self.done or later.done, later.error, self.accepted or later.accepted)


class Job:
    """One prompt of an HTTP request; its updates go, tagged with `index`, onto the request's asyncio queue."""

    def __init__(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 updates: asyncio.Queue, index: int = 0):
        self.prompt, self.params, self.loop, self.updates, self.index = prompt, params, loop, updates, index
        self.rid: int | None = None
        self.sent = [0] * params.n  # tokens handed out per completion (for their logprobs)
        self.ended = 0  # completions whose finish reason has been handed out

    def push(self, update: Update) -> None:
        push_all([(self, update)])


def push_all(updates: list[tuple[Job, Update]]) -> None:
    """Hand each job its update: one wake-up of each event loop for all its jobs (a thread-safe call costs the
    engine thread several microseconds; 256 streams would pay it 256 times a step)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, update in updates:
        by_loop.setdefault(job.loop, []).append((job.updates, (job.index, update)))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


def _put_all(items: list) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class EngineWorker:
    """Owns `engine` on a background thread; `submit` and `cancel` may be called from any thread."""

    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.05):
        self.engine, self.metrics, self.idle_wait_s = engine, metrics, idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._jobs: dict[int, Job] = {}
        self._stopping = False
        self.error: str | None = None  # set if the loop itself died
        self._thread = threading.Thread(target=self._run, name="glint-engine", daemon=True)

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, job: Job) -> Job:
        if self.is_alive:
            self._send("add", job)
        if not self.is_alive:  # dead before, or while, it was sent: its last drain may have missed this job
            job.push(Update(error=f"the engine is not running ({self.error or 'stopped'})"))
        return job

    def cancel(self, job: Job, client_gone: bool = False) -> None:
        """Abort the job's request: its pages are freed at the next step (a no-op once it finished)."""
        self._send("cancel", job, client_gone)

    def _send(self, *message) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                if self.engine.has_unfinished():
                    t0 = time.perf_counter()
                    try:
                        self.engine.step()
                    except EngineFailed:
                        raise  # the engine takes no more steps: this loop dies, is_alive turns False
                    except Exception as e:  # the step undid itself: fail the requests, keep serving the next
                        log.exception("engine step failed")
                        self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
                        continue
                    self._observe(time.perf_counter() - t0)
                    self._deliver()
                else:
                    self._deliver()  # requests aborted while nothing ran are finished and released here
                    self._observe(None)
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # never leave callers waiting forever
            self.error = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
        message = f"the engine stopped: {self.error or 'shut down'}"
        self._fail_all(message)
        while True:  # and whatever was still on its way in
            try:
                kind, job, *_ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                job.push(Update(error=message))

    def _drain(self) -> None:
        while True:
            try:
                kind, job, *args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    job.rid = self.engine.add_request(job.prompt, job.params)
                except ValueError as e:
                    job.push(Update(error=str(e)))
                    continue
                self._jobs[job.rid] = job
                job.push(Update(accepted=True))
            elif job.rid not in self._jobs:
                continue  # refused, or finished and released already
            else:
                self.engine.abort(job.rid)
                if args[0] and self.metrics is not None:
                    self.metrics.aborted.inc()

    def _deliver(self) -> None:
        updates = []
        try:
            for rid, job in list(self._jobs.items()):
                tokens = self.engine.new_tokens(rid)
                reasons = self.engine.finish_reasons(rid)
                ended = sum(r is not None for r in reasons)
                if not any(tokens) and ended == job.ended:
                    continue
                update = Update(tokens=tokens, finish_reasons=reasons if ended else None,
                                done=ended == len(reasons))
                if job.params.logprobs:
                    update.logprobs = self.engine.logprobs_since(rid, job.sent)
                job.sent = [n + len(t) for n, t in zip(job.sent, tokens)]
                job.ended = ended
                if update.done:
                    self.engine.release(rid)
                    del self._jobs[rid]
                updates.append((job, update))
        finally:  # what was taken from the engine reaches its callers, whatever failed after
            push_all(updates)

    def _fail_all(self, message: str) -> None:
        for rid, job in list(self._jobs.items()):
            try:
                self.engine.abort(rid)
                self.engine.release(rid)
            except ValueError:
                pass
            job.push(Update(error=message))
        self._jobs.clear()

    def _observe(self, step_s: float | None) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.engine, step_s)
