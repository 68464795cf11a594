"""Retrying a failed message later (pure): the policies, and reading a rejected message.

A consumer that cannot handle a message now rejects it (`basic.reject` / `basic.nack` with
`requeue=false`) from a queue whose dead-letter exchange is `<prefix>.retry`, or publishes
it there itself with `x-retry-queue` (and `x-retry-reason`, if it likes). The gateway sends
it back to that queue after the policy's delay, with the attempt number in
`x-retry-attempt`; after the last attempt it parks it with the reason.

A policy: the first delay `base_ms`, multiplied by `factor` at each attempt, capped at
`cap_ms`, plus jitter that only adds (a uniform share of the delay, up to `jitter`: 0.2
means up to 20 % more), for at most `attempts` retries. Per-queue policies override the
default for the queues whose name matches their pattern (shell-style: `orders.*`), the
first that matches.
"""

import datetime
import fnmatch
import json
import math
import random
from dataclasses import dataclass, fields, replace
from typing import Any, List, Optional, Sequence, Tuple

from gateway.core import envelope, wire
from gateway.core.wire import Properties, Table

ATTEMPT = "x-retry-attempt"  # the attempt a consumer receives: 1 on the first retry
QUEUE = "x-retry-queue"  # the source queue, from a consumer that publishes to the retry exchange itself
REASON = "x-retry-reason"  # why it failed, from the consumer (optional)
# What a broker's dead-lettering says a consumer did: retried. Anything else the source
# queue dead-letters (its TTL, its length limit) is not a failure to retry: parked.
RETRIED_DEATHS = ("rejected", "delivery_limit")
LONGEST_MS = 315_360_000_000  # ten years: a retry delay is a delay like any other
GAVE_UP = "gave up after "  # how the reason of a message parked after its last attempt starts


class BadPolicy(ValueError):
    """A retry policy that cannot be: one line, exit 2."""


@dataclass(frozen=True)
class Policy:
    base_ms: int = 1000
    factor: float = 2.0
    cap_ms: int = 3_600_000
    attempts: int = 10
    jitter: float = 0.2
    queue: str = "*"  # the pattern of the queues it is for

    def __post_init__(self) -> None:
        whole = isinstance(self.base_ms, int) and isinstance(self.cap_ms, int)
        checks = [
            (isinstance(self.base_ms, int) and 1 <= self.base_ms <= LONGEST_MS, "base_ms", "from 1 to 10 years in ms"),
            (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and 1 <= self.factor <= 1000,
             "factor", "from 1 to 1000"),
            (whole and self.base_ms <= self.cap_ms <= LONGEST_MS, "cap_ms", "at least base_ms, at most 10 years in ms"),
            (isinstance(self.attempts, int) and 0 <= self.attempts <= 1000, "attempts", "from 0 to 1000"),
            (isinstance(self.jitter, (int, float)) and 0 <= self.jitter <= 1, "jitter", "from 0 to 1"),
            (isinstance(self.queue, str) and self.queue != "", "queue", "a queue name or pattern"),
        ]
        for ok, name, wanted in checks:
            if not ok:
                which = "the default retry policy (--retry-*)" if self.queue == "*" else \
                    f"the retry policy for {self.queue!r}"
                raise BadPolicy(f"{which}: {name} {getattr(self, name)!r} must be {wanted}")

    def planned_ms(self, attempt: int) -> int:
        """The delay before `attempt` (1: the first retry), before jitter."""
        return min(self.cap_ms, math.ceil(self.base_ms * self.factor ** min(attempt - 1, 4000)))

    def delay_ms(self, attempt: int, rng: random.Random) -> int:
        planned = self.planned_ms(attempt)
        return planned + math.floor(planned * self.jitter * rng.random())


def policies(default: Policy, overrides: str) -> Tuple[Policy, ...]:
    """The per-queue policies (a JSON list of objects: `queue` and any of the default's
    fields, which they override), then the default. Raises BadPolicy."""
    if not overrides.strip():
        return (default,)
    try:
        given = json.loads(overrides)
    except json.JSONDecodeError as exc:
        raise BadPolicy(f"retry policies are not JSON: {exc}") from None
    if not isinstance(given, list) or not all(isinstance(p, dict) for p in given):
        raise BadPolicy('retry policies must be a JSON list of objects, like [{"queue": "orders.*", "attempts": 5}]')
    names = {f.name for f in fields(Policy)}
    out: List[Policy] = []
    for p in given:
        unknown = sorted(set(p) - names)
        if unknown:
            raise BadPolicy(f"retry policy {json.dumps(p)}: unknown {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(names))})")
        if "queue" not in p:
            raise BadPolicy(f"retry policy {json.dumps(p)}: give the queue (a name or a pattern like orders.*)")
        out.append(replace(default, **p))
    return tuple(out) + (default,)


def allowed(queue: str, patterns: str) -> bool:
    """Whether retries may go back to this queue (`--retry-queues`: comma-separated patterns)."""
    return any(fnmatch.fnmatchcase(queue, p.strip()) for p in patterns.split(",") if p.strip())


def policy_for(queue: str, found: Sequence[Policy]) -> Policy:
    """The first policy whose pattern matches the queue (the default's matches any)."""
    return next(p for p in found if p.queue == "*" or fnmatch.fnmatchcase(queue, p.queue))


@dataclass(frozen=True)
class Failure:
    """What a rejected message says about itself."""

    queue: Optional[str]  # where it came from (None: it cannot be told)
    attempt: int  # the attempt it is to become (1: the first retry)
    reason: Optional[str]  # the consumer's, if it gave one
    not_retried: Optional[str] = None  # why it is parked instead (a death that is no failure)


def failure(headers: Table) -> Failure:
    """Read a message that reached the retry exchange (its headers as the broker gave them)."""
    previous = headers.get(ATTEMPT)
    attempt = (previous if isinstance(previous, int) and not isinstance(previous, bool) and previous > 0 else 0) + 1
    reason = _text(headers.get(REASON))
    death = envelope.last_death(headers)
    if death is not None:
        queue, why = _text(death.get("queue")), _text(death.get("reason"))
        if why not in RETRIED_DEATHS:
            return Failure(queue, attempt, reason, f"dead-lettered from queue {queue!r} ({why}), not rejected by a "
                                                   "consumer: only a rejection is retried")
        return Failure(queue, attempt, reason)
    return Failure(_text(headers.get(QUEUE)), attempt, reason)


def rejected_by_us(headers: Table) -> Optional[int]:
    """When the broker dead-lettered this rejection at the latest (the end of the second its
    `x-death` says, on the broker's clock), in µs; None if it does not say. A retry read long
    after (an outage, a backlog) was taken in then, not when it was read: a cancel published
    meanwhile came after it."""
    death = envelope.last_death(headers)
    when = death.get("time") if death is not None else None
    if isinstance(when, datetime.datetime):
        return (int(when.timestamp()) + 1) * 1_000_000 - 1
    return None


def _text(value: Any) -> Optional[str]:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    return value if isinstance(value, str) and value else None


def attempted(user: Properties, attempt: int) -> Properties:
    """The consumer's properties as it will receive the retry: `x-retry-attempt` set."""
    headers = user.values.get("headers") or Table()
    return user.replace(headers=headers.with_entry(wire.long(ATTEMPT, attempt)))


def afresh(user: Properties) -> Properties:
    """The properties of a retry started over (`parked replay`): no attempt counted."""
    headers = user.values.get("headers")
    if headers is None or headers.get(ATTEMPT) is None:
        return user
    left = headers.without(lambda name: name == ATTEMPT)
    return user.replace(headers=left if left else None)
