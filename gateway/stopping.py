"""Signal handlers that stop a loop waiting on a threading.Event."""

import threading
from typing import Any, Callable


def setter(event: threading.Event) -> Callable[..., None]:
    """A signal handler that sets `event`, from another thread: a handler runs on the main
    thread between two bytecodes, possibly inside event.wait() while that holds the event's
    own lock, and set() would wait for it forever."""
    def handle(*_: Any) -> None:
        threading.Thread(target=event.set, name="signal").start()
    return handle
