"""Names of everything the gateway declares, derived from one prefix."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    prefix: str = "delay"

    def __post_init__(self) -> None:
        if not self.prefix or len(self.prefix.encode()) > 200:
            raise ValueError("prefix must be 1 to 200 bytes long")
        if any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must not contain white space")

    def _(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    @property
    def check_in(self) -> str:
        return self._("check-in")

    @property
    def meditation(self) -> str:
        return self._("meditation")

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

    def level(self, k: int) -> str:
        return self._(f"level.{k:02d}")

    def delay_queue(self, k: int) -> str:
        return self._(f"level.{k:02d}.delay")

    def pass_queue(self, k: int) -> str:
        return self._(f"level.{k:02d}.pass")

    def below(self, k: int) -> str:
        """Where level k's queues dead-letter to: level k-1, or the distributor after level 0."""
        return self.level(k - 1) if k > 0 else self.distributor
