"""Which messages a filter selects (pure): by message id or handle, routing key pattern, due
time, header value and retries. `delay-gateway pending` lists by it; a group cancel (a rule:
rules.py) cancels by it, in every gateway, the same way. A key pattern is matched word by
word, in time linear in the key (never by a regex: a hostile pattern stalled it), and is at
most as long as a routing key.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from gateway.core.wire import Table

# A routing key, and so a binding key or a filter's pattern, is at most 255 bytes in AMQP (a
# shortstr): at most 128 words, so a matcher's state set fits in 129 bits.
MAX_PATTERN_BYTES = 255


def _collapsed(words: List[str]) -> List[str]:
    """Runs of '*' and '#' with a '#' in them as their '*'s then one '#' (`#.#` is `#`, `#.*`
    is `*.#`): a '#' is then never followed by another, so one closure step follows it."""
    out: List[str] = []
    stars, hashed = 0, False
    for word in words + [""]:  # a sentinel that ends the last run
        if word == "*":
            stars += 1
        elif word == "#":
            hashed = True
        else:
            out += ["*"] * stars + (["#"] if hashed else [])
            out.append(word)
            stars, hashed = 0, False
    return out[:-1]


def normalized(pattern: str) -> str:
    """The pattern in its collapsed form: two patterns that select the same keys this way are
    stored and compared as one."""
    return ".".join(_collapsed(pattern.split("."))) if pattern else ""


def selects_every_key(pattern: str) -> bool:
    """Whether the pattern selects every routing key, the empty one too (it is `#`, however
    spelled)."""
    return normalized(pattern) == "#"


def checked_pattern(pattern: str) -> str:
    """A pattern a client sent, normalised; ValueError when longer than any key it could match."""
    size = len(pattern.encode("utf-8"))
    if size > MAX_PATTERN_BYTES:
        raise ValueError(f"a key pattern is at most {MAX_PATTERN_BYTES} bytes (AMQP's limit on a routing key),"
                         f" this one is {size}")
    return normalized(pattern)


class TopicMatcher:
    """An AMQP topic pattern as a test of routing keys (bytes), as RabbitMQ matches them.

    Not a regex: a pattern of many '#' made the backtracking one take minutes per key. The
    pattern runs as an NFA over the key's words, its state set an int (bit i: the first i
    words of its collapsed form are matched), so a key costs one step per word, whatever
    the pattern.
    """

    __slots__ = ("pattern", "_masks", "_stars", "_hashes", "_start", "_accept", "_sink")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        words = _collapsed(pattern.split(".")) if pattern else []
        stars = hashes = 0
        literals: Dict[bytes, int] = {}
        for i, word in enumerate(words):
            if word == "*":
                stars |= 1 << i
            elif word == "#":
                hashes |= 1 << i
            else:
                key = word.encode("utf-8")
                literals[key] = literals.get(key, 0) | 1 << i
        # what a key's word lets advance: the '*'s, and the literals equal to it
        self._masks = {word: bits | stars for word, bits in literals.items()}
        self._stars = stars
        self._hashes = hashes
        self._start = 1 | (1 & hashes) << 1
        self._accept = 1 << len(words)
        # a last '#' once reached matches whatever is left of the key
        self._sink = hashes & (1 << (len(words) - 1) if words else 0)

    def walk(self, key: bytes) -> Tuple[int, int]:
        """The state set after the key's words (0 once none can match) and how many of its
        words it took: never more than the key has (what tests check the linear bound by)."""
        states, hashes, masks, stars, sink = self._start, self._hashes, self._masks, self._stars, self._sink
        if states & sink or not key:
            return states, 0
        walked = 0
        for word in key.split(b"."):
            walked += 1
            states = (states & masks.get(word, stars)) << 1 | states & hashes
            states |= (states & hashes) << 1
            if not states or states & sink:
                break
        return states, walked

    def __call__(self, key: bytes) -> bool:
        return bool(self.walk(key)[0] & self._accept)

    def __repr__(self) -> str:
        return f"TopicMatcher({self.pattern!r})"


def topic_pattern(pattern: str) -> Callable[[bytes], bool]:
    """An AMQP topic pattern ('*' one word, '#' zero or more) as a test of routing keys
    (bytes), as RabbitMQ matches them: an empty key has no words; in time linear in the key."""
    return TopicMatcher(pattern)


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
