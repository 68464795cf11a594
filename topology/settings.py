"""The topology settings of the public contract, validated once."""

from dataclasses import dataclass, field

from topology.names import Names, generation

QUEUE_TYPES = ("quorum", "classic")
ZERO_BITS = ("queue", "exchange")

# rabbit_misc:check_expiry rejects a larger x-message-ttl (10 years).
MAX_TTL_MS = 315_360_000_000
MAX_LEVELS = 40


@dataclass(frozen=True)
class ChainSettings:
    prefix: str = "delay"
    max_level: int = 20
    resolution_ms: int = 1000
    queue_type: str = "quorum"
    zero_bits: str = "queue"
    names: Names = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_level, int) or not 1 <= self.max_level <= MAX_LEVELS:
            raise ValueError(f"max_level must be an integer from 1 to {MAX_LEVELS}, got {self.max_level!r}")
        if not isinstance(self.resolution_ms, int) or self.resolution_ms < 1:
            raise ValueError(f"resolution_ms must be a positive integer, got {self.resolution_ms!r}")
        if self.queue_type not in QUEUE_TYPES:
            raise ValueError(f"queue_type must be one of {', '.join(QUEUE_TYPES)}, got {self.queue_type!r}")
        if self.zero_bits not in ZERO_BITS:
            raise ValueError(f"zero_bits must be one of {', '.join(ZERO_BITS)}, got {self.zero_bits!r}")
        if self.resolution_ms > MAX_TTL_MS:
            raise ValueError(f"resolution_ms {self.resolution_ms} is longer than RabbitMQ's longest queue TTL, "
                             f"{MAX_TTL_MS} ms (10 years): use resolution_ms <= {MAX_TTL_MS}")
        if self.meditation_ms > MAX_TTL_MS:
            longest = max_level_for(self.resolution_ms)
            raise ValueError(
                f"max_level {self.max_level} at resolution_ms {self.resolution_ms} needs a "
                f"{self.meditation_ms} ms queue TTL; RabbitMQ allows at most {MAX_TTL_MS} ms "
                f"(10 years): use max_level <= {longest} at this resolution"
            )
        object.__setattr__(self, "names", Names(self.prefix, generation(
            self.resolution_ms, self.queue_type, self.zero_bits), self.queue_type))

    @property
    def max_units(self) -> int:
        """The longest wait the chain expresses, in resolution units (all bits set)."""
        return (1 << self.max_level) - 1

    @property
    def generation(self) -> str:
        return self.names.generation

    @property
    def meditation(self) -> str:
        """The meditation queue (and its exchange) of this chain."""
        return self.names.meditation(self.max_level)

    @property
    def meditation_ms(self) -> int:
        return self.max_units * self.resolution_ms

    def level_ttl_ms(self, k: int) -> int:
        return (1 << k) * self.resolution_ms


def max_level_for(resolution_ms: int) -> int:
    """The largest max_level whose meditation TTL RabbitMQ accepts at this resolution."""
    level = 0
    while level < MAX_LEVELS and ((1 << (level + 1)) - 1) * resolution_ms <= MAX_TTL_MS:
        level += 1
    return level
