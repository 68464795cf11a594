"""The catch-up after an outage (pure): overdue messages released at most so fast.

When a distributor comes back after an outage, everything that fell due meanwhile reaches
it at once. With a catch-up rate set (`--catch-up-rate`), a message that reaches the
distributor more than OVERDUE_AFTER_MS after its due time waits in its memory, most overdue
first, and is released at most `rate` a second, while messages that reach it in time are
released at their time as always. Overdue counts from the later of its due time and when
the gateway took it in: a message its publisher sent already past its time (`x-deliver-at`
in the past) is not a backlog, so no publisher can jump the catch-up's queue, slow it, or
pile messages up in the distributor's memory by sending such times. Nothing else changes:
a waiting overdue message is held like any other (its delivery unacknowledged until its
publish is confirmed, a cancel still wins at its release, a crash hands it back to be read
again).
"""

from typing import Optional

# A message reaching the distributor this much after its due time is overdue: more than
# the chain's hop latency under load, far less than an outage.
OVERDUE_AFTER_MS = 1000


class CatchUp:
    """A token bucket: `rate` releases a second, up to a tenth of a second's worth at once."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError("a catch-up rate is above 0")
        self.rate = rate
        self._burst = max(1.0, rate / 10)
        self._tokens = self._burst
        self._at: Optional[int] = None  # when the tokens were last counted (ms, a steady clock)

    @staticmethod
    def since(due_ms: int, accepted_us: Optional[int]) -> int:
        """When a message fell due inside the gateway (epoch ms): its due time, or when the
        gateway took it in if that was later (None, or a negative time from a move: unknown)."""
        return due_ms if accepted_us is None or accepted_us // 1000 <= due_ms else accepted_us // 1000

    @staticmethod
    def overdue(since_ms: int, now: int) -> bool:
        return now - since_ms > OVERDUE_AFTER_MS

    def allowance(self, now: int) -> int:
        """How many overdue messages may be released now (then say how many were: `spent`)."""
        if self._at is not None and now > self._at:
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self.rate / 1000)
        if self._at is None or now > self._at:
            self._at = now
        return int(self._tokens)

    def spent(self, released: int) -> None:
        self._tokens -= released

    def next_at(self) -> int:
        """When the next release is allowed (on the clock of `allowance`): a tick is due then
        if any wait."""
        at = self._at if self._at is not None else 0
        missing = 1 - self._tokens
        return at if missing <= 0 else at + max(1, int(missing * 1000 / self.rate + 0.999))
