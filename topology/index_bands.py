"""The waiting streams: the index of what waits that the gateways write and `delay-gateway
pending` reads (gateway/core/index_records.py). Here: how many a chain needs, their routing keys,
and how long each keeps its records.

Band b holds the entries of messages that wait up to 4^b s where they were sent (a lap of
meditation, or until due); a reader reads band b from its span before the oldest time a
message may still wait, so a listing reads what waits and, of what passed through, a span.
"""

from topology.settings import ChainSettings

BASE_MS = 1000
BANDS = 16  # 4^15 s is 34 years: more than any queue TTL RabbitMQ allows (10 years)
DONE = "done"  # the routing key (and name) of the stream of done records and gateways' beats
# What each stream keeps beyond its span: how long a reader can look back for messages that
# nobody delivered (no gateway ran, or the broker held them back).
RETENTION_SLACK_MS = 3_600_000
SEGMENT_BYTES = 4_000_000  # the unit a stream's retention removes (RabbitMQ's default: 500 MB)


def band(stay_ms: int) -> int:
    """The band of a wait this long: the smallest b with stay_ms <= 4^b s."""
    b = 0
    while stay_ms > span_ms(b) and b < BANDS - 1:
        b += 1
    return b


def span_ms(b: int) -> int:
    return BASE_MS << (2 * b)  # x 4^b


def bands(settings: ChainSettings) -> int:
    """How many bands a chain needs: its longest wait is a lap of meditation."""
    return band(settings.meditation_ms) + 1


def band_key(b: int) -> str:
    return f"{b:02d}"


def max_age_s(key: str) -> int:
    """A stream's x-max-age: its span (none for done records), and the slack."""
    span = 0 if key == DONE else span_ms(int(key))
    return (span + RETENTION_SLACK_MS) // 1000
