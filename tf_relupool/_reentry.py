"""A per-thread re-entry mark for trace-time wrappers: while a wrapper calls the function it
wraps (`with mark:`), the wrappers that function reaches pass straight through
(`mark.active()`)."""
import threading


class Reentry:
    def __init__(self):
        self._local = threading.local()

    def __enter__(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        self._local.depth -= 1

    def active(self):
        return getattr(self._local, "depth", 0) > 0
