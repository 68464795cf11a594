"""Which messages a filter selects (pure): by message id or handle, routing key pattern, due
time, header value and retries. `delay-gateway pending` lists by it; a group cancel (a rule:
rules.py) cancels by it, in every gateway, the same way.
"""

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from gateway.core.wire import Table


def topic_pattern(pattern: str) -> Callable[[bytes], bool]:
    """An AMQP topic pattern ('*' one word, '#' zero or more) as a test of routing keys
    (bytes), as RabbitMQ matches them: an empty key has no words."""
    words = pattern.encode("utf-8").split(b".") if pattern else []
    parts = [b"(?:\\.[^.]*)*" if w == b"#" else b"\\.[^.]*" if w == b"*" else b"\\." + re.escape(w) for w in words]
    regex = re.compile(b"".join(parts), re.DOTALL)
    # every word of the key after a dot: a pattern's word is then always "a dot and a word"
    return lambda key: regex.fullmatch(b"." + key if key else b"") is not None


_COMPILED: Dict[str, Callable[[bytes], bool]] = {}


def compiled(pattern: str) -> Callable[[bytes], bool]:
    found = _COMPILED.get(pattern)
    if found is None:
        if len(_COMPILED) > 4096:
            _COMPILED.clear()
        found = _COMPILED[pattern] = topic_pattern(pattern)
    return found


def literal_words(pattern: str) -> List[bytes]:
    """The words a pattern starts with before its first wildcard: every key it matches starts
    with them (what rules.Rules indexes a rule by)."""
    out = []
    for word in (pattern.encode("utf-8").split(b".") if pattern else []):
        if word in (b"*", b"#"):
            break
        out.append(word)
    return out


def header_matches(table: Table, name: str, value: str) -> bool:
    """A header's value read as text (a number as its digits, text as it is) equals `value`."""
    found = table.get(name)
    if found is None:
        return False
    if isinstance(found, bytes):
        found = found.decode("utf-8", "replace")
    if isinstance(found, bool):
        return value.lower() == str(found).lower()
    return str(found) == value


def id_matches(wanted: bytes, ident: bytes) -> bool:
    """An id filter (exact, or a prefix where it ends with '*') against an id or a handle."""
    return ident.startswith(wanted[:-1]) if wanted.endswith(b"*") else ident == wanted


@dataclass(frozen=True)
class Selection:
    """What a filter selects: every filter given must hold (none given: everything)."""

    ids: Tuple[bytes, ...] = ()  # exact, or a prefix where it ends with '*'; a handle ('@...') any message's
    key: Optional[str] = None  # an AMQP topic pattern on the routing key it arrives with
    due_after_ms: Optional[int] = None
    due_before_ms: Optional[int] = None
    headers: Tuple[Tuple[str, str], ...] = ()  # (name, value as text)
    retries: bool = False
    _key: Optional[Callable[[bytes], bool]] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.key is not None:
            object.__setattr__(self, "_key", compiled(self.key))

    @property
    def empty(self) -> bool:
        """No filter at all: it selects every message."""
        return not (self.ids or self.key is not None or self.due_after_ms is not None
                    or self.due_before_ms is not None or self.headers or self.retries)

    def matches(self, message_id: Optional[bytes], routing_key: bytes, due_ms: int, retry: bool,
                headers: Callable[[], Table], handle: Callable[[], bytes]) -> bool:
        """Whether a message with these is selected; `headers` and `handle` are asked only when
        a filter needs them (reading them costs)."""
        if self.due_after_ms is not None and due_ms < self.due_after_ms:
            return False
        if self.due_before_ms is not None and due_ms > self.due_before_ms:
            return False
        if self.retries and not retry:
            return False
        if self._key is not None and not self._key(routing_key):
            return False
        if self.ids:
            if not any(id_matches(i, handle() if i.startswith(b"@") or message_id is None else message_id)
                       for i in self.ids):
                return False
        if self.headers:
            table = headers()
            return all(header_matches(table, name, value) for name, value in self.headers)
        return True

    def describe(self) -> str:
        """For people: the filters, as `pending` takes them."""
        parts = [f"--id {i.decode('utf-8', 'backslashreplace')}" for i in self.ids]
        if self.key is not None:
            parts.append(f"--key {self.key}")
        if self.due_after_ms is not None:
            parts.append(f"--due-after {self.due_after_ms}")
        if self.due_before_ms is not None:
            parts.append(f"--due-before {self.due_before_ms}")
        parts += [f"--header {n}={v}" for n, v in self.headers]
        if self.retries:
            parts.append("--retries")
        return " ".join(parts) or "(every message: --all)"
