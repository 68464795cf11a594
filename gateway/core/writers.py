"""Who wrote a record in the gateway's streams, and whether a reader trusts it (pure).

Every record a gateway appends to the waiting streams (entries, done keys, beats, marks)
and to the cancellations stream (cancels, rules, withdrawals, marks, tallies) carries the
AMQP `user_id` property: the user the gateway logged in as (`signed`). The broker checks it
against the publishing connection's user and refuses a forged one (406 PRECONDITION_FAILED,
unless the user has the `impersonator` tag), so a reader knows who appended each record.
Readers trust the records of one user, the gateways' (`--gateway-user`, by default the
user of the first URL):

- signed by that user: read;
- signed by another user (someone else with write permission on the stream's exchange):
  ignored, and counted, so that an answer can say so;
- unsigned: written by a version before 1.0 (or by a tool that does not sign). A gateway
  still reads the unsigned cancels by id and marks of the cancellations stream (0.1.0 wrote
  them: a rolling upgrade keeps its cancels); no release wrote rules, tallies or read-time
  reservations unsigned, so unsigned ones are ignored. A command reads unsigned records of
  the index (0.1.0 wrote them) but never lets one hide a message (index_streams.py), and says
  its answer is not exact (`UNTRUSTED`).
"""

import enum
from dataclasses import dataclass
from typing import Optional

from gateway.core import cancels
from gateway.core.wire import Properties, Table

USER_ID = "user_id"
UNTRUSTED = "records from before 1.0 or from another user"
# What a reader keeps of an unsigned record of the cancellations stream: a cancel by id (and
# its times), a mark, a tally (rules.TALLY's headers), and what the broker adds.
_STREAM_HEADERS = ("x-stream-offset", "timestamp_in_ms")
# (Cancels by id and marks: 0.1.0 wrote them unsigned. Tallies and read-time reservations are
# 1.0's, signed: a forged reservation would hold every later gateway's read times ahead.)
_UNSIGNED_CANCELLATIONS = _STREAM_HEADERS + (cancels.RECORD_ID, cancels.RECORD_AT, cancels.RECORD_ARRIVED,
                                             cancels.RECORD_MARK)


class Writer(enum.Enum):
    GATEWAY = "gateway"  # signed by the trusted user
    UNSIGNED = "unsigned"  # no user_id: a version before 1.0
    OTHER = "other"  # signed by another user


def signed(props: Properties, user: str) -> Properties:
    """A record's properties, signed by the user the writing connection logged in as."""
    return props.replace(user_id=user.encode("utf-8"))


def user_of(props: Properties) -> Optional[str]:
    value = props.get(USER_ID)
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return value if isinstance(value, str) else None


def writer(props: Properties, trusted: str) -> Writer:
    """Who wrote a record with these properties, as a reader that trusts `trusted` sees it."""
    user = user_of(props)
    return Writer.UNSIGNED if user is None else Writer.GATEWAY if user == trusted else Writer.OTHER


def cancellation_headers(props: Properties, trusted: str) -> Table:
    """What a reader of the cancellations stream reads of a record's headers: all of them when
    the gateway signed it; of an unsigned one, a cancel by id, a mark or a tally (never a
    rule); of another user's, nothing but the stream's offset."""
    found = writer(props, trusted)
    headers = props.headers
    if found is Writer.GATEWAY:
        return headers
    keep = _UNSIGNED_CANCELLATIONS if found is Writer.UNSIGNED else _STREAM_HEADERS
    return headers.without(lambda name: name not in keep)


@dataclass
class Doubts:
    """What a reader passed over or used with doubt: records of another user (ignored) and
    unsigned ones (used). Either makes an answer not exact."""

    other: int = 0
    unsigned: int = 0

    def count(self, found: Writer) -> None:
        if found is Writer.OTHER:
            self.other += 1
        elif found is Writer.UNSIGNED:
            self.unsigned += 1

    def __bool__(self) -> bool:
        return bool(self.other or self.unsigned)

    def why(self, where: str) -> str:
        parts = ([f"{self.unsigned} unsigned record(s) read"] if self.unsigned else []) + \
            ([f"{self.other} record(s) of another user ignored"] if self.other else [])
        return f"{UNTRUSTED} in {where}: {', '.join(parts)}"
