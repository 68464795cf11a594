"""How a delay becomes a route through the level chain.

The chain has `max_level` levels. Level k holds a message for 2^k resolution units (its
delay queue) or lets it fall through (its 1 ms pass-through queue, or an
exchange-to-exchange binding), then dead-letters it to level k-1; level 0 dead-letters to
the distributor. Writing the wait in binary therefore picks, level by level, "wait" (1) or
"pass" (0), and any whole number of units up to 2^max_level - 1 is expressible.

The bits travel in the routing key, least significant first, one word per level:
11 units = 0b1011 -> key "1.1.0.1". Level k's exchange looks only at word k
(bindings "*.*.1.#" and "*.*.0.#" with k stars), so the patterns are anchored at the left
and end in a single "#": topic matching stays linear in the key's length. The key has as
many words as the message has levels to go: a message enters at the level of its highest
1 bit, never at the top, which keeps short delays off the long levels and their keys short.
The user's routing key never enters the topic; it rides in a header and the distributor
restores it.

Rounding is always down: the chain waits floor((remaining - lead) / resolution) units, so
a message reaches the distributor a little before it is due (by less than one unit plus
`lead_ms`, the allowance for the chain's own hop latency). The distributor holds it,
unacknowledged, until the exact due time: never early, and a crash while holding means a
redelivery, not a loss. A wait too long for the chain goes to the meditation queue, whose
TTL is the chain's maximum, and comes back to check-in for another look.
"""

from dataclasses import dataclass
from typing import Union

from topology.settings import ChainSettings


@dataclass(frozen=True)
class ToDistributor:
    """Less than one unit to go: straight to the distributor, which holds the rest."""


@dataclass(frozen=True)
class Meditate:
    """More than the chain can express: wait the chain's maximum, then check in again."""


@dataclass(frozen=True)
class Enter:
    """Publish to level `level`'s exchange with the bit key `key`."""

    level: int
    key: str

    def __post_init__(self) -> None:
        if self.level != len(self.key.split(".")) - 1 or not self.key.endswith("1"):
            raise ValueError(f"key {self.key!r} does not start at level {self.level}")


Route = Union[ToDistributor, Meditate, Enter]


def units_for(remaining_ms: int, resolution_ms: int, lead_ms: int = 0) -> int:
    """Whole units the chain may wait without making the message late."""
    return max(0, (remaining_ms - lead_ms) // resolution_ms)


def bit_key(units: int) -> str:
    if units < 1:
        raise ValueError("a bit key needs at least one unit")
    return ".".join("1" if units >> i & 1 else "0" for i in range(units.bit_length()))


def key_units(key: str) -> int:
    """The inverse of bit_key."""
    words = key.split(".")
    if not words or any(w not in ("0", "1") for w in words):
        raise ValueError(f"{key!r} is not a bit key")
    return sum(1 << i for i, w in enumerate(words) if w == "1")


def plan(remaining_ms: int, chain: ChainSettings, lead_ms: int = 0) -> Route:
    units = units_for(remaining_ms, chain.resolution_ms, lead_ms)
    if units == 0:
        return ToDistributor()
    if units > chain.max_units:
        return Meditate()
    return Enter(level=units.bit_length() - 1, key=bit_key(units))


def level_pattern(k: int, bit: str) -> str:
    """The binding key that matches bit `bit` at level k (word k of a bit key)."""
    return "*." * k + bit + ".#"
