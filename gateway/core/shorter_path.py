"""Which messages take the shorter path, straight to the distributor (pure): those due within
`within_ms`, and as the rate rises only those due sooner, so that what the path holds stays
about `messages`. At a trickle every message due within `within_ms` skips the chain's queues
(their writes are most of what the broker spends on it); at high rates carriers share those
writes, and the chain keeps the waiting in the broker, not in the distributor's memory."""

from typing import Optional


class ShorterPath:
    """One consumer's rule (check-in, returning, retry): time comes in with each message."""

    def __init__(self, within_ms: int, messages: int) -> None:
        self.within_ms, self.messages = within_ms, messages
        self._second = 0  # the second (epoch) being counted
        self._this = self._last = 0  # messages seen in it, and in the second before

    def reach_ms(self, rate: int) -> Optional[int]:
        """How long to go a message may have and take it, at `rate` messages a second (at least
        the one it reads); None: the path is off."""
        if not self.within_ms:
            return None
        return min(self.within_ms, self.messages * 1000 // max(1, rate))

    def takes(self, remaining_ms: int, now_ms: int) -> bool:
        """Whether a message with this long to go takes it (counted as one more seen now)."""
        if not self.within_ms:
            return False
        second = now_ms // 1000
        if second != self._second:
            self._last = self._this if second == self._second + 1 else 0
            self._second, self._this = second, 0
        self._this += 1
        reach = self.reach_ms(max(self._last, self._this))  # the rate: at least the one seen now
        return reach is not None and remaining_ms <= reach

    def at_rate(self, rate: int, now_ms: int) -> None:
        """Count as if `rate` messages came in the second before `now_ms`: what it decides at
        `now_ms` is then what it decides at that rate (`delay-gateway explain --rate`)."""
        self._second, self._this, self._last = now_ms // 1000, 0, rate
