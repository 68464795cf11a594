"""When `run` tries the broker again and when it gives up (pure: the clock is injected).

A connection that dies is opened again with exponential backoff and full jitter. The
backoff starts over only after a connection stayed up and consuming for a while: one that
dies within seconds (a broker that accepts and then drops us) must not turn into a
reconnect loop. Troubles that might heal (no broker answers, a connection lost) are
retried until `connect_timeout` has passed without a working session; those that cannot
(amqp.classify: the topology or the permissions are wrong) end the process after
FATAL_ATTEMPTS in a row.
"""

import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

from gateway.broker.plumbing.amqp import Trouble
from gateway.exits import EXIT_NO_BROKER, EXIT_REFUSED

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 10.0
FATAL_ATTEMPTS = 3  # troubles that do not heal: give up after this many in a row


class Backoff:
    """Exponential with full jitter; starts over only after a stable connection."""

    def __init__(self, first: float = BACKOFF_FIRST_S, longest: float = BACKOFF_MAX_S,
                 rng: Optional[random.Random] = None) -> None:
        self.first, self.longest, self.attempt = first, longest, 0
        self.rng = rng or random.Random()

    def next(self, stable: bool) -> float:
        if stable:
            self.attempt = 0
        delay = min(self.longest, self.first * 2 ** self.attempt)
        self.attempt += 1
        return delay / 2 + self.rng.uniform(0, delay / 2)


@dataclass(frozen=True)
class Next:
    """What to do after a session ended: exit with `exit_code`, or wait `wait_s` and try again."""

    exit_code: Optional[int] = None
    wait_s: float = 0.0
    refused: int = 0  # troubles that cannot heal, in a row (this one included)


class Reconnects:
    def __init__(self, connect_timeout: float, clock: Callable[[], float] = time.monotonic,
                 backoff: Optional[Backoff] = None) -> None:
        self.connect_timeout, self.clock = connect_timeout, clock
        self.backoff = backoff or Backoff()
        self.refused = 0
        self.last_up = clock()

    def up(self) -> None:
        """A session got as far as consuming."""
        self.last_up = self.clock()

    def after(self, trouble: Optional[Trouble], stable: bool) -> Next:
        """The session ended with `trouble` (None: the connection closed without one);
        `stable`: it had been up and consuming long enough to start the backoff over."""
        if trouble is not None and not trouble.heals:
            self.refused = 0 if stable else self.refused + 1
            if self.refused >= FATAL_ATTEMPTS:
                return Next(exit_code=EXIT_REFUSED, refused=self.refused)
        elif self.clock() - self.last_up > self.connect_timeout:
            return Next(exit_code=EXIT_NO_BROKER)
        return Next(wait_s=self.backoff.next(stable), refused=self.refused)
