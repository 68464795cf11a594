"""How the tests wait: a condition asked again until it holds or a deadline passes.

The one way tests wait for something, never a fixed sleep. tests/support.py re-exports it;
the launcher and the private nodes of the fault tests take it from here, as they import
nothing of the gateway's.
"""

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "",
               fail: bool = True, sleep: Callable[[float], object] = time.sleep) -> T:
    """The first truthy value of `condition()`, asked every `interval` s. When none came
    within `timeout` s: a test failure naming `what`, or (fail=False) the last value, for a
    caller that checks it itself. `sleep` passes each interval: a pika connection's own
    `sleep` keeps its I/O going meanwhile (heartbeats, deliveries to its consumers). A
    condition that collects what it sees returns a value once it has enough; one that raises
    ends the wait at once (a process that exited, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            if not value and fail:
                raise AssertionError(f"{what or 'the condition'}: not within {timeout:g} s (last: {value!r})")
            return value
        sleep(interval)
