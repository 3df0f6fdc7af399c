"""A background thread that keeps the next items of a producer ready (bounded queue).

The role of PyTorch's ``DataLoader(num_workers=N)`` in Megatron's
``build_pretraining_data_loader`` (megatron/training/datasets/data_samplers.py): the
next batches are built while the accelerator runs the current step. jmegatron's batches
are numpy reads of memory-mapped ``.bin`` files and small index arithmetic, so one thread
(no worker processes, no pickling) keeps up with the step; ``depth`` bounds how many
finished items wait in memory.

Contract (what the tests check, tests/test_data_loader.py):

* items come out in the order ``produce()`` made them; ``get()`` returns the next one;
* an exception raised by ``produce()`` is re-raised by the ``get()`` that asks for the
  item it concerns (the items made before it are handed out first), with its own type and
  traceback; the thread stops after it;
* :meth:`Prefetcher.close` stops the thread and joins it (idempotent; also on ``with``
  exit); the thread is a daemon, so even a forgotten ``close()`` never blocks the
  interpreter's exit.
"""

from __future__ import annotations

import queue
import threading
import warnings
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_POLL_S = 0.05  # how often a blocked put/get looks at the stop flag


class Prefetcher(Generic[T]):
    """Calls ``produce()`` repeatedly in a daemon thread, up to ``depth`` results ahead.

    Args:
        produce: makes the next item (called only from the thread, never concurrently).
        depth: finished items kept waiting (>= 1).
        name: the thread's name (shows in tracebacks and ``py-spy``).

    Raises:
        ValueError: ``depth < 1``.
    """

    def __init__(self, produce: Callable[[], T], depth: int = 2, name: str = "jmegatron-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth={depth} must be >= 1 (0 means: no prefetch thread)")
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._failed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = (True, self._produce())
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, re-raised there
                self._put((False, e))
                return
            if not self._put(item):
                return

    def get(self) -> T:
        """The next item; re-raises the producer's exception at the item it concerns.

        Raises:
            RuntimeError: the prefetcher was closed.
            Exception: whatever ``produce()`` raised for this item.
        """
        while True:
            if self._stop.is_set():
                raise RuntimeError("the prefetcher is closed")
            try:
                ok, value = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without an item or an error") from None
                continue
            if not ok:
                self._failed = True
                self.close()
                raise value
            return value

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the thread and join it (an item being produced is finished, then dropped).
        Returns whether it stopped; a thread still inside ``produce()`` after ``timeout``
        seconds is left behind with a warning, never an exception (close runs in the
        training loop's ``finally``, before the checkpointer's close): it is a daemon and
        cannot outlive the interpreter."""
        self._stop.set()
        if self._thread is threading.current_thread():
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn(f"the prefetch thread {self._thread.name!r} did not stop within {timeout} s (its "
                          "produce() call is still running); it is a daemon thread and ends with the process",
                          RuntimeWarning, stacklevel=2)
            return False
        while True:  # drop finished items: their memory goes now, not with the object
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        return True

    @property
    def alive(self) -> bool:
        """Whether the thread is running."""
        return self._thread.is_alive()

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
