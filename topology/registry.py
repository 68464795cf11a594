"""Which chains exist under a prefix, and how far their retirement has come (pure).

AMQP cannot list queues or exchanges, and a chain's names depend on its settings, whose
values (a resolution in ms) cannot be guessed. So the chains are recorded in the stream
`<prefix>.chains`, one JSON record per message, appended by `delay-gateway declare` and by
every gateway for the chain it runs with:

- `declared`: a chain (its generation's settings and its max_level) was declared, or a
  gateway runs with it. Appended when the chain is not already recorded as declared, and
  again when its retirement had begun: that cancels the retirement (see `sealed`).
- `sealed`: retiring these queues began; for each, the time by which it is empty by
  construction (nothing can enter it any more, and its TTLs have run out). A seal counts
  only while no chain using the queue was declared after it (stream order, not clocks).
- `retired`: every object of this chain that no other chain needs is gone.
- `unlisted`: messages sent on meanwhile may wait without an entry in the index of what
  waits (gateway/core/index_records.py) until `until_ms`: appended when the index is first
  declared where messages already wait (an upgrade from a version without it), and by a
  gateway that runs without writing entries (--no-pending-index). `pending` says so.

Reading the stream takes nothing away, so any number of gateways and `status` commands can
read it at the same time. A record that cannot be read (not ours, a newer schema) is
skipped: the worst a missing record can do is keep an old chain a little longer.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from topology.names import Names, generation
from topology.settings import ChainSettings

Json = Dict[str, Any]  # a JSON object

SCHEMA = 1
EVENTS = ("declared", "sealed", "retired", "unlisted")


@dataclass(frozen=True, order=True)
class ChainKey:
    """One chain: the settings that shape its names and queues (a generation) and its
    number of levels. Two chains of one generation share their levels."""

    resolution_ms: int
    queue_type: str
    zero_bits: str
    max_level: int

    @classmethod
    def of(cls, chain: ChainSettings) -> "ChainKey":
        return cls(chain.resolution_ms, chain.queue_type, chain.zero_bits, chain.max_level)

    @property
    def generation(self) -> str:
        return generation(self.resolution_ms, self.queue_type, self.zero_bits)

    def settings(self, prefix: str) -> ChainSettings:
        return ChainSettings(prefix=prefix, max_level=self.max_level, resolution_ms=self.resolution_ms,
                             queue_type=self.queue_type, zero_bits=self.zero_bits)

    def with_levels(self, max_level: int) -> "ChainKey":
        return ChainKey(self.resolution_ms, self.queue_type, self.zero_bits, max_level)

    def describe(self) -> str:
        return f"{self.generation}, {self.max_level} levels"


@dataclass(frozen=True)
class Record:
    event: str
    at_ms: int  # when it was written, for people (decisions use the stream's order)
    chain: Optional[ChainKey] = None  # declared, retired
    queues: Mapping[str, int] = field(default_factory=dict)  # sealed: queue -> empty by (epoch ms)
    until_ms: Optional[int] = None  # unlisted: until when
    why: str = ""  # unlisted: what may wait unlisted, for people

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown registry event {self.event!r}")
        if (self.chain is None) != (self.event in ("sealed", "unlisted")):
            raise ValueError(f"a {self.event} record {'has no' if self.chain else 'needs a'} chain")
        if (self.until_ms is None) != (self.event != "unlisted"):
            raise ValueError(f"an unlisted record needs until_ms, and only it has one ({self.event})")


def encode(record: Record) -> bytes:
    body: Json = {"schema": SCHEMA, "event": record.event, "at_ms": record.at_ms}
    if record.chain is not None:
        c = record.chain
        body["chain"] = {"resolution_ms": c.resolution_ms, "queue_type": c.queue_type,
                         "zero_bits": c.zero_bits, "max_level": c.max_level}
    if record.queues:
        body["queues"] = dict(record.queues)
    if record.until_ms is not None:
        body["until_ms"] = record.until_ms
        body["why"] = record.why
    return json.dumps(body, sort_keys=True).encode()


def decode(body: bytes) -> Optional[Record]:
    """The record in `body`, or None if it is not one this version can read."""
    try:
        doc = json.loads(body)
        if doc.get("schema") != SCHEMA:
            return None
        chain = doc.get("chain")
        key = None if chain is None else ChainKey(int(chain["resolution_ms"]), str(chain["queue_type"]),
                                                  str(chain["zero_bits"]), int(chain["max_level"]))
        queues = {str(q): int(t) for q, t in (doc.get("queues") or {}).items()}
        until = doc.get("until_ms")
        return Record(str(doc["event"]), int(doc["at_ms"]), key, queues, None if until is None else int(until),
                      str(doc.get("why", "")))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


@dataclass(frozen=True)
class Seal:
    empty_by_ms: int
    seq: int  # position in the stream


@dataclass
class Registry:
    """The records folded: each chain's latest state, and each queue's latest seal."""

    state: Dict[ChainKey, str] = field(default_factory=dict)  # declared | retired
    declared_seq: Dict[ChainKey, int] = field(default_factory=dict)  # position of the latest `declared`
    declared_at: Dict[ChainKey, int] = field(default_factory=dict)
    seals: Dict[str, Seal] = field(default_factory=dict)
    unlisted: List[Record] = field(default_factory=list)  # what may wait unlisted, and until when
    records: int = 0

    @property
    def declared(self) -> Tuple[ChainKey, ...]:
        return tuple(sorted(k for k, s in self.state.items() if s == "declared"))

    @property
    def retired(self) -> Tuple[ChainKey, ...]:
        return tuple(sorted(k for k, s in self.state.items() if s == "retired"))

    def seal(self, queue: str, users: Iterable[ChainKey]) -> Optional[int]:
        """When `queue` is empty by construction, if its retirement stands: no chain that
        uses it (`users`) was declared after it was sealed."""
        s = self.seals.get(queue)
        if s is None:
            return None
        if any(self.declared_seq.get(u, -1) > s.seq for u in users):
            return None
        return s.empty_by_ms

    def needs_record(self, key: ChainKey, prefix: str) -> bool:
        """Whether a gateway running `key` must append a `declared` record: the chain is not
        recorded as declared, or retiring some of its queues has begun since."""
        if self.state.get(key) != "declared":
            return True
        since = self.declared_seq[key]
        return any(self.seals.get(q, Seal(0, -1)).seq > since for q in chain_queues(key, Names(
            prefix, key.generation)))


def fold(records: Iterable[Record]) -> Registry:
    r = Registry()
    for seq, record in enumerate(records):
        r.records += 1
        if record.event == "sealed":
            for queue, empty_by in record.queues.items():
                r.seals[queue] = Seal(empty_by, seq)
            continue
        if record.event == "unlisted":
            r.unlisted.append(record)
            continue
        if record.chain is None:  # (Record allows none only in a sealed record)
            continue
        r.state[record.chain] = record.event
        if record.event == "declared":
            r.declared_seq[record.chain] = seq
            r.declared_at[record.chain] = record.at_ms
    return r


# -- the objects of one chain --------------------------------------------------------------
def level_queues(key: ChainKey, names: Names, k: int) -> List[str]:
    return [names.delay_queue(k)] + ([names.pass_queue(k)] if key.zero_bits == "queue" else [])


def chain_queues(key: ChainKey, names: Names) -> List[str]:
    """Every queue the chain uses, shared levels included."""
    out = [names.meditation(key.max_level), names.gateways(key.max_level)]
    for k in range(key.max_level):
        out += level_queues(key, names, k)
    return out
