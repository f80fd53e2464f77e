"""A per-thread re-entry mark for trace-time wrappers: while a wrapper calls the function it
wraps (`with mark:`), the wrappers that function reaches pass straight through
(`mark.active()`); and a per-thread recorder of trace-time decisions."""
import contextlib
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


class Recorder:
    """Per-thread collection for fusion_report: `with recorder.recording() as events:` collects
    what `recorder.add(event)` is given on this thread while the block runs (nested blocks
    collect their own)."""

    def __init__(self):
        self._local = threading.local()

    @contextlib.contextmanager
    def recording(self):
        previous = getattr(self._local, "events", None)
        self._local.events = events = []
        try:
            yield events
        finally:
            self._local.events = previous

    def active(self):
        return getattr(self._local, "events", None) is not None

    def add(self, event):
        events = getattr(self._local, "events", None)
        if events is not None:
            events.append(event)

    def discard(self, drop):
        """Removes the events collected on this thread for which drop(event) is true."""
        events = getattr(self._local, "events", None)
        if events is not None:
            events[:] = [e for e in events if not drop(e)]
