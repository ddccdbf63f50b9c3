"""How a sink never costs a run and never loses a finding quietly.

Two private bases, one mechanism:

- :class:`_Buffered` writes on the caller's thread. What it could not write waits in a
  bounded queue, oldest first, and is retried at the next ``flush``; past the bound a
  finding is dropped and counted in :attr:`~stethoscope.sinks.Sink.dropped`. The file
  sinks and the TensorBoard sink use it: a local write is fast, and a failing one
  (a full disk) fails fast.
- :class:`_Background` keeps the same queue but drains it on a worker thread, for sinks
  that talk over the network (MLflow): a slow or dead server never stalls a step, and
  ``flush`` and ``close`` wait for it at most ``flush_timeout`` / ``close_timeout``.

A subclass implements ``_send(items)``: deliver these items or raise. Items are opaque
to the queue; each is marked as a finding or not, so that only findings are counted as
dropped (a header or a run tag is bookkeeping, not something the user would miss).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any

from stethoscope.sinks.base import Sink

__all__: list[str] = []  # private: the public surface is each sink's own class

#: The default bound of the retry queue, in items (about one finding each).
MAX_BUFFER = 10_000


class _Unsent(Exception):
    """Raised by ``_send`` when only part of an item went out: ``rest`` is still to send."""

    def __init__(self, rest: Any) -> None:
        super().__init__("partly written")
        self.rest = rest


def _check_max_buffer(value: Any, *, sink: str) -> int:
    """``max_buffer`` as an int >= 0, or the error that names it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{sink}: max_buffer={value!r} must be an integer >= 0 (findings kept in memory "
            f"while the destination fails), e.g. {MAX_BUFFER}"
        )
    return value


def _check_timeout(value: Any, *, name: str, sink: str) -> float:
    """A timeout as a float >= 0 seconds, or the error that names it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{sink}: {name}={value!r} must be a number of seconds >= 0")
    return float(value)


def _write_all(file: Any, data: bytes) -> None:
    """Write ``data`` to an unbuffered file, looping over short writes.

    Raises:
        _Unsent: The write failed after part of ``data`` went out; ``rest`` is the part
            that did not, so a retry completes the line instead of writing it twice.
        OSError: The write failed before anything went out.
    """
    view = memoryview(data)
    try:
        while view:
            n = file.write(view)
            if n is None:  # a non-blocking file (a full pipe) that would block
                raise BlockingIOError(errno.EAGAIN, "the destination would block")
            view = view[n:]
    except Exception as exc:
        if len(view) < len(data):
            raise _Unsent(bytes(view)) from exc
        raise


class _Buffered(Sink):
    """A sink whose writes may fail: what fails waits, bounded, and is retried at flush.

    Subclasses call :meth:`_init_buffer` in ``__init__``, hand every item to
    :meth:`_deliver`, call :meth:`_retry` in ``flush`` and :meth:`_give_up` in ``close``,
    and implement :meth:`_send`.
    """

    max_buffer: int

    def _init_buffer(self, *, max_buffer: int) -> None:
        self.max_buffer = _check_max_buffer(max_buffer, sink=type(self).__name__)
        # (is_finding, item), oldest first. Only what could not be written waits here.
        self._pending: deque[tuple[bool, Any]] = deque()
        self._dropped = 0
        self._last_error: BaseException | None = None
        self._warned: set[str] = set()

    # -- the public face ------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Findings given up since the sink was made: the queue was full, or still held
        them at ``close``."""
        return self._dropped

    @property
    def pending(self) -> int:
        """Items waiting to be written (findings, and the odd header or tag)."""
        return len(self._pending)

    @property
    def last_error(self) -> BaseException | None:
        """The most recent failure to write, or ``None`` if there never was one."""
        return self._last_error

    # -- for subclasses --------------------------------------------------------------
    def _send(self, items: list[Any]) -> None:
        """Deliver ``items`` in order, or raise (``_Unsent`` if only part of one went)."""
        raise NotImplementedError

    def _destination(self) -> str:
        """Where the sink writes, for messages."""
        return repr(self)

    def _deliver(self, item: Any, *, finding: bool = True) -> None:
        """Write ``item`` now; if that fails, or older items still wait, queue it."""
        if self._pending:  # never let a new item overtake an older one
            self._hold(item, finding)
            return
        try:
            self._send([item])
        except _Unsent as exc:
            self._hold(exc.rest, finding)
            self._failed(exc.__cause__ or exc)
        except Exception as exc:
            self._hold(item, finding)
            self._failed(exc)

    def _retry(self) -> bool:
        """Write what waits, oldest first, until a write fails; True if nothing waits."""
        while self._pending:
            finding, item = self._pending[0]
            try:
                self._send([item])
            except _Unsent as exc:
                self._pending[0] = (finding, exc.rest)
                self._failed(exc.__cause__ or exc)
                return False
            except Exception as exc:
                self._failed(exc)
                return False
            self._pending.popleft()
        return True

    def _hold(self, item: Any, finding: bool) -> None:
        """Queue ``item``, or count it as dropped when the queue is full."""
        if len(self._pending) < self.max_buffer:
            self._pending.append((finding, item))
            return
        # Past the bound the newest is dropped, not the oldest: the first findings of a
        # failure are usually its cause, the later ones its consequences.
        if finding:  # a header or a run tag is bookkeeping, not a finding the user misses
            self._dropped += 1
        self._warn_once(
            "dropping",
            f"{type(self).__name__} holds {self.max_buffer} findings not yet written to "
            f"{self._destination()} (max_buffer={self.max_buffer}) and now drops new ones; "
            "the epoch summary counts them",
        )

    def _give_up(self, why: str = "") -> None:
        """At close: what still waits is lost. Count it and say where it was going."""
        lost = sum(1 for finding, _ in self._pending if finding)
        self._pending.clear()
        if lost:
            self._dropped += lost
            self._warn(
                f"{type(self).__name__} could not write {lost} finding(s) to "
                f"{self._destination()} before closing "
                f"({why or repr(self._last_error)}){self._lost_note()}"
            )

    def _lost_note(self) -> str:
        """Where the findings given up at close can still be found, if anywhere."""
        return "; they are lost"

    def _failed(self, exc: BaseException) -> None:
        self._last_error = exc
        self._warn_once(
            "failed",
            f"{type(self).__name__} could not write to {self._destination()}: {exc!r}; "
            f"training goes on, and the sink keeps up to max_buffer={self.max_buffer} "
            "findings in memory and retries at the next flush (epoch end)",
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self._warn(message)

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(f"stethoscope: {message}", RuntimeWarning, stacklevel=4)


class _Background(_Buffered):
    """A :class:`_Buffered` sink whose queue a worker thread drains.

    ``_deliver`` only queues, so it costs the training thread a lock and an append.
    The worker sends the oldest items; when a send fails it stops until the next
    ``flush`` asks for a retry, so a dead server is not hammered every step. ``flush``
    waits up to ``flush_timeout`` for the queue to empty (not at all when the last send
    failed: the server is probably still down, and an epoch end should not pay for it);
    ``close`` waits up to ``close_timeout``, then gives up on what is left. A request
    still in flight at that point finishes on its own in the (daemon) worker, which
    then stops; the network client's own timeout bounds it.
    """

    #: Most items ``_send`` receives at once; ``_batch`` decides which may go together.
    _batch_size = 1

    def _init_background(
        self, *, max_buffer: int, flush_timeout: float, close_timeout: float
    ) -> None:
        name = type(self).__name__
        self._init_buffer(max_buffer=max_buffer)
        self.flush_timeout = _check_timeout(flush_timeout, name="flush_timeout", sink=name)
        self.close_timeout = _check_timeout(close_timeout, name="close_timeout", sink=name)
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._generation = 0  # bumped at close: a worker of an older generation stops
        self._paused = False  # the last send failed: wait for a flush before retrying

    # -- caller's thread ---------------------------------------------------------------
    def _deliver(self, item: Any, *, finding: bool = True) -> None:
        with self._cond:
            self._hold(item, finding)
            self._start_worker()
            self._cond.notify_all()

    def _flush_background(self) -> bool:
        """Ask the worker to retry and drain; wait a bounded time. True if drained."""
        with self._cond:
            failing = self._paused
            self._paused = False
            if self._pending:
                self._start_worker()
            self._cond.notify_all()
        if failing:
            return False
        return self._wait_idle(self.flush_timeout)

    def _close_background(self) -> bool:
        """Drain for up to ``close_timeout``, stop the worker, give up on the rest."""
        with self._cond:
            self._paused = False
            if self._pending:
                self._start_worker()
            self._cond.notify_all()
        drained = self._wait_idle(self.close_timeout)
        with self._cond:
            self._generation += 1
            self._worker = None
            self._cond.notify_all()
            why = "" if self._paused else f"still sending after close_timeout={self.close_timeout}s"
            self._paused = False
            self._give_up(why)
        _OPEN.discard(self)
        return drained

    def _wait_idle(self, timeout: float) -> bool:
        """Wait until nothing waits or a send failed, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending and not self._paused:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self._pending

    def _start_worker(self) -> None:
        """Start the worker if it is not running. Call with the lock held."""
        if self._worker is not None and self._worker.is_alive():
            return
        self._generation += 1
        self._worker = threading.Thread(
            target=self._run,
            args=(self._generation,),
            name=f"stethoscope-{type(self).__name__}",
            # A daemon, so a hung server never keeps the process alive at exit; the
            # atexit hook below gives it close_timeout to finish first.
            daemon=True,
        )
        self._worker.start()
        _OPEN.add(self)

    def _batch(self) -> list[Any]:
        """The items at the head of the queue to send together (at least one)."""
        return [self._pending[0][1]]

    # -- worker thread -----------------------------------------------------------------
    def _run(self, generation: int) -> None:
        while True:
            with self._cond:
                while generation == self._generation and (not self._pending or self._paused):
                    self._cond.wait()
                if generation != self._generation:
                    return
                batch = self._batch()
            try:
                self._send(batch)
            except Exception as exc:
                with self._cond:
                    if generation == self._generation:
                        self._paused = True
                        # Warnings turned into errors (-W error) must not kill the worker.
                        with contextlib.suppress(Exception):
                            self._failed(exc)
                    self._cond.notify_all()
                continue
            with self._cond:
                if generation == self._generation:
                    for _ in batch:
                        self._pending.popleft()
                self._cond.notify_all()


#: Background sinks with a live worker, closed at interpreter exit if nobody closed them.
_OPEN: weakref.WeakSet[_Background] = weakref.WeakSet()


@atexit.register
def _close_open_sinks() -> None:
    # A script that drives a Monitor without closing it would otherwise lose what its
    # workers still hold; each waits at most its close_timeout.
    for sink in list(_OPEN):
        with contextlib.suppress(Exception):  # at exit there is no one left to tell
            sink.close()
