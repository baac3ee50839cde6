"""The launch thread: each step's device programs run in dispatch order on a thread of their own, while the
host schedules, packs and postprocesses other steps (EngineConfig.async_launch)."""
from __future__ import annotations

import atexit
import concurrent.futures
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable


class Launcher:
    """Runs each step's device programs, in the order the steps were dispatched.

    Threaded (`EngineConfig.async_launch`), on a thread of its own: XLA's launch of a step (updating and
    launching its CUDA graph) takes milliseconds of host time and releases the GIL, so the host schedules,
    packs and postprocesses other steps meanwhile, as vLLM's async scheduling and SGLang's overlap scheduler
    do. Otherwise in the caller, before `submit` returns. A job's exception is raised where its future's result
    is taken, and kept in `error`; every job after a failed one raises that exception too (it would run on state
    the failed one may have consumed).

    The thread is a daemon, so a launch that never returns (a hung driver) cannot keep the process from exiting;
    at exit a launch under way gets EXIT_WAIT_S to finish first, and jobs submitted after that (by an exit hook
    that runs later) run in the caller: nothing is left running on the thread when the interpreter finalizes.
    It ends with its launcher.
    """

    EXIT_WAIT_S = 10.0

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._last: concurrent.futures.Future | None = None
        self.error: BaseException | None = None
        self._jobs: queue.SimpleQueue | None = None
        if threaded:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_launch_loop, args=(self._jobs,), name="glint-launch", daemon=True).start()
            # not at exit: an exit hook registered before this one may still step the engine
            weakref.finalize(self, self._jobs.put, None).atexit = False
            _LAUNCHERS.add(self)
            _register_exit_hook()

    def submit(self, job: Callable[[], object]) -> concurrent.futures.Future:
        done = concurrent.futures.Future()
        if self._jobs is None:
            done.set_result(job())
            return done
        if _exiting:  # after the exit hook: in the caller, once the thread has run what it was given
            self.drain()
            try:
                done.set_result(self._guarded(job))
            except BaseException as e:  # noqa: BLE001 - the future carries it to whoever takes the result
                done.set_exception(e)
            self._last = done
            return done
        self._last = done
        self._jobs.put((done, functools.partial(self._guarded, job)))
        time.sleep(0)  # let the launch thread take the GIL now, not after this thread's next switch interval
        return done

    def _guarded(self, job: Callable[[], object]):
        if self.error is not None:
            raise self.error
        try:
            return job()
        except BaseException as e:
            self.error = e
            raise

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job submitted so far has run (its exception, if any, stays in its future)."""
        if self._last is not None:
            concurrent.futures.wait([self._last], timeout=timeout)


_LAUNCHERS: weakref.WeakSet[Launcher] = weakref.WeakSet()  # the threaded ones alive, for the exit hook
_exiting = False  # set by the exit hook: launches run in the caller from then on


def _launch_loop(jobs: queue.SimpleQueue) -> None:
    """The launch thread: runs (future, job) pairs until it is handed None. Holds no reference to its launcher,
    which may then be collected (and hand it None).

    Once a job's future is resolved, whoever waited on it may be leaving the interpreter, so this thread frees
    nothing after that: a job's captures go before, its future and result when the next job comes. (Freeing a jax
    array may give the GIL up inside C++; a daemon thread taking it back while the interpreter finalizes is ended
    by a forced unwind, which aborts the process there: "FATAL: exception not rethrown".)"""
    while (item := jobs.get()) is not None:
        done, job = item
        del item
        try:
            result = job()
        except BaseException as e:  # noqa: BLE001 - the future carries it to whoever takes the result
            del job
            done.set_exception(e)
            # Not kept: the exception's traceback holds the launcher and the engine (their frames), which this
            # frame would keep alive for good (no next job comes to a failed engine). The launcher's `error`
            # holds the exception, so only the future's shell is freed here.
            del done
        else:
            del job
            done.set_result(result)


def _finish_launches() -> None:
    global _exiting
    _exiting = True
    for launcher in list(_LAUNCHERS):
        launcher.drain(timeout=Launcher.EXIT_WAIT_S)


@functools.cache
def _register_exit_hook() -> None:
    """Once, when the first launch thread starts: after jax registered its own clean-up, so this runs first."""
    atexit.register(_finish_launches)
