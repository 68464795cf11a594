"""Names of everything the gateway declares, derived from one prefix.

Two kinds of object share the prefix:
- the gateway's fixed objects (`<prefix>.check-in`, `<prefix>.pick-up`, `<prefix>.parked`, and
  the internal `returning`, `distributor` and `parking`): their names and arguments never
  depend on the chain's settings, so they survive any change of the chain;
- the chain, whose queue arguments (TTLs, queue type) and bindings do depend on them. Its
  objects carry a generation tag made of the settings that shape them, e.g.
  `delay.1000ms-quorum-queue.level.03.delay`, so that a chain with other settings can be
  declared beside a running one (queue arguments cannot change once declared). `max_level`
  is not in the tag: level k is the same queue whatever the number of levels above it, so
  raising or lowering it only adds or retires levels and the meditation queue, which is
  named by the level count it serves.

Two more objects make changing the chain on a live broker safe (topology/registry.py):
`<prefix>.chains`, a stream recording which generations were declared (AMQP cannot list
queues), and per chain and level count a `gateways.NN` queue that every gateway using those
settings consumes, so its consumer count says whether any gateway still publishes into them.
"""

from dataclasses import dataclass

MAX_PREFIX_BYTES = 120  # keeps the longest chain name within AMQP's 255 bytes


def generation(resolution_ms: int, queue_type: str, zero_bits: str) -> str:
    return f"{resolution_ms}ms-{queue_type}-{zero_bits}"


@dataclass(frozen=True)
class Names:
    prefix: str = "delay"
    generation: str = "1000ms-quorum-queue"
    queue_type: str = "quorum"

    def __post_init__(self) -> None:
        if not self.prefix or len(self.prefix.encode()) > MAX_PREFIX_BYTES:
            raise ValueError(f"prefix must be 1 to {MAX_PREFIX_BYTES} bytes long")
        if any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must not contain white space")

    def _(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    # -- fixed: the contract's names and the gateway's own queues -----------------------
    @property
    def check_in(self) -> str:
        """Exchange (topic, no arguments: the contract) and the queue behind it."""
        return self._("check-in")

    @property
    def returning(self) -> str:
        """Internal exchange and queue: messages back from meditation. Only dead-lettering
        can put a message here (clients cannot publish to an internal exchange), so what
        arrives here is the gateway's own and its headers can be trusted."""
        return self._("returning")

    @property
    def distributor(self) -> str:
        return self._("distributor")

    @property
    def pick_up(self) -> str:
        return self._("pick-up")

    @property
    def parking(self) -> str:
        """Inbox of messages to park: the gateway adds the reason and moves them on."""
        return self._("parking")

    @property
    def parked(self) -> str:
        return self._("parked")

    # -- the chain's exits, by queue type -------------------------------------------------
    # A chain dead-letters into its exits (the distributor after level 0, returning after
    # meditation) in its own queue type: a classic queue dead-letters at most once, and one
    # whose target is a quorum queue drops what it expires while the broker starts (the
    # quorum queues are not up yet). So a classic chain has classic exits of its own,
    # beside the quorum ones every chain shares; both are found by name alone.
    def exit_distributor(self, queue_type: str) -> str:
        return self.distributor if queue_type == "quorum" else f"{self.distributor}.{queue_type}"

    def exit_returning(self, queue_type: str) -> str:
        return self.returning if queue_type == "quorum" else f"{self.returning}.{queue_type}"

    @property
    def cancel(self) -> str:
        """Exchange (fanout, no arguments: the contract) where publishers send cancels; bound
        to the check-in queue, so a cancel queues behind the messages published before it."""
        return self._("cancel")

    @property
    def rules(self) -> str:
        """Exchange (fanout, no arguments) where group cancels (rules) and their withdrawals
        are sent; bound to the check-in queue like `cancel`. Apart from `cancel`, so that the
        right to cancel one id (write on `cancel`) does not grant cancelling groups."""
        return self._("rules")

    @property
    def cancellations(self) -> str:
        """Exchange and stream of recorded cancels, which every gateway follows."""
        return self._("cancellations")

    @property
    def retry(self) -> str:
        """Exchange (fanout, no arguments) and queue of failed messages to retry later: the
        dead-letter exchange of the queues whose consumers want retries."""
        return self._("retry")

    @property
    def waiting(self) -> str:
        """Exchange (topic, exact keys) in front of the waiting streams: the index of what waits, which
        `delay-gateway pending` reads (gateway/core/index_records.py)."""
        return self._("waiting")

    def waiting_stream(self, key: str) -> str:
        """A waiting stream, by its routing key: a band ("00", "01", ...) or "done"."""
        return f"{self.waiting}.{key}"

    @property
    def registry(self) -> str:
        """The stream that records each chain declared under this prefix."""
        return self._("chains")

    # -- the chain of one generation ----------------------------------------------------
    @property
    def chain(self) -> str:
        """The common start of every name of this generation's chain."""
        return self._(self.generation)

    def meditation(self, max_level: int) -> str:
        return f"{self.chain}.meditation.{max_level:02d}"

    def gateways(self, max_level: int) -> str:
        """Consumed (never published to) by every gateway running with this chain and level
        count: its consumer count is how many such gateways are connected."""
        return f"{self.chain}.gateways.{max_level:02d}"

    def level(self, k: int) -> str:
        return f"{self.chain}.level.{k:02d}"

    def delay_queue(self, k: int) -> str:
        return f"{self.level(k)}.delay"

    def pass_queue(self, k: int) -> str:
        return f"{self.level(k)}.pass"

    def below(self, k: int) -> str:
        """Where level k's queues dead-letter to: level k-1, or the chain's distributor after level 0."""
        return self.level(k - 1) if k > 0 else self.exit_distributor(self.queue_type)
