"""AMQP 0-9-1 content properties and field tables as bytes: read without loss, never fail.

A publisher's properties must reach pick-up exactly as sent: every header with the wire
type it was sent with (a short int stays a short int, a 32-bit float stays a float, a
decimal keeps its scale), names and strings that are not UTF-8 included. Python values
cannot say all that, so the gateway keeps the bytes: a `Table` is the list of its entries,
each with its name, type octet and value bytes exactly as received, and re-encodes to the
same bytes. Values are decoded only when read, and only the few the gateway needs (the
delay headers, its own headers); a value that does not decode reads as `Opaque` and still
travels unchanged. Nothing here raises on any input: a table that cannot be parsed at all
is kept as one opaque blob.

Pure: no I/O, no pika.
"""

import datetime
import decimal
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

Name = Union[str, bytes]

# Fixed sizes of the value types RabbitMQ knows (rabbit_binary_parser), and pika's 'L' and
# 'U'; the variable ones (S, x, A, F) carry a 32-bit length, D is 5 bytes.
_FIXED = {b"t": 1, b"b": 1, b"B": 1, b"s": 2, b"u": 2, b"U": 2, b"I": 4, b"i": 4, b"l": 8, b"L": 8,
          b"f": 4, b"d": 8, b"T": 8, b"D": 5, b"V": 0}
_LENGTH = (b"S", b"x", b"A", b"F")
_STRUCT = {b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"U": ">h", b"I": ">i", b"i": ">I",
           b"l": ">q", b"L": ">q", b"f": ">f", b"d": ">d", b"T": ">Q"}


@dataclass(frozen=True)
class Opaque:
    """A value that could not be decoded; its bytes travel unchanged."""

    kind: bytes
    raw: bytes

    def __repr__(self) -> str:
        return f"Opaque({self.kind!r}, {len(self.raw)} bytes)"


class Malformed(ValueError):
    pass


def _value_end(data: bytes, offset: int, kind: bytes) -> int:
    """Where the value of `kind` starting at `offset` ends."""
    if kind in _FIXED:
        end = offset + _FIXED[kind]
    elif kind in _LENGTH:
        if offset + 4 > len(data):
            raise Malformed("truncated length")
        end = offset + 4 + struct.unpack_from(">I", data, offset)[0]
    else:
        raise Malformed(f"unknown field type {kind!r}")
    if end > len(data):
        raise Malformed("truncated value")
    return end


def decode_value(kind: bytes, raw: bytes) -> Any:
    """The Python value of one field; Opaque when it cannot be represented."""
    try:
        return _decode_value(kind, raw)
    except (Malformed, struct.error, ValueError, OverflowError, decimal.InvalidOperation):
        return Opaque(kind, raw)


def _decode_value(kind: bytes, raw: bytes) -> Any:
    if kind == b"t":
        return bool(raw[0])
    if kind in _STRUCT and kind != b"T":
        return struct.unpack(_STRUCT[kind], raw)[0]
    if kind == b"T":
        seconds = struct.unpack(">Q", raw)[0]
        try:
            return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        except (OverflowError, OSError, ValueError):
            return Opaque(kind, raw)  # past the year 9999: pika's own decoder crashes here
    if kind == b"D":
        scale, digits = struct.unpack(">Bi", raw)
        return decimal.Decimal(digits).scaleb(-scale)
    if kind == b"V":
        return None
    if kind == b"S":
        value = raw[4:]
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    if kind == b"x":
        return raw[4:]
    if kind == b"F":
        return Table.parse(raw[4:]).to_dict()
    if kind == b"A":
        return [decode_value(k, v) for k, v in _array_items(raw[4:])]
    raise Malformed(f"unknown field type {kind!r}")


def _array_items(data: bytes) -> Iterator[Tuple[bytes, bytes]]:
    offset = 0
    while offset < len(data):
        kind = data[offset:offset + 1]
        end = _value_end(data, offset + 1, kind)
        yield kind, data[offset + 1:end]
        offset = end


def _name(raw: bytes) -> Name:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _raw_name(name: Name) -> bytes:
    return name if isinstance(name, bytes) else name.encode("utf-8")


class TableField(NamedTuple):
    """One field of an AMQP field table: its name, type octet and value bytes. (A tuple:
    every header of every message read makes one, and a tuple is the cheapest to make.)"""
    name: bytes
    kind: bytes
    raw: bytes  # the value's bytes, after the type octet

    @property
    def value(self) -> Any:
        return decode_value(self.kind, self.raw)

    def encode(self) -> bytes:
        return bytes([len(self.name)]) + self.name + self.kind + self.raw


class Table:
    """An AMQP field table as its entries, in order, bytes kept (see the module doc)."""

    __slots__ = ("entries", "tail")

    def __init__(self, entries: Sequence[TableField] = (), tail: bytes = b"") -> None:
        self.entries: Tuple[TableField, ...] = tuple(entries)
        self.tail = tail  # bytes after the last entry that could be parsed (kept as they are)

    @classmethod
    def parse(cls, data: bytes) -> "Table":
        """The table's content (without its 32-bit length). Never raises."""
        entries: List[TableField] = []
        offset = 0
        try:
            while offset < len(data):
                length = data[offset]
                name = data[offset + 1:offset + 1 + length]
                kind = data[offset + 1 + length:offset + 2 + length]
                if len(name) != length or len(kind) != 1:
                    raise Malformed("truncated entry")
                start = offset + 2 + length
                end = _value_end(data, start, kind)
                entries.append(TableField(name, kind, data[start:end]))
                offset = end
        except Malformed:
            return cls(entries, data[offset:])
        return cls(entries)

    def encode(self) -> bytes:
        """The table with its 32-bit length, as it came in (or as changed)."""
        content = b"".join(e.encode() for e in self.entries) + self.tail
        return struct.pack(">I", len(content)) + content

    def find(self, name: Name) -> Optional[TableField]:
        raw = _raw_name(name)
        for e in self.entries:
            if e.name == raw:
                return e
        return None

    def get(self, name: Name, default: Any = None) -> Any:
        e = self.find(name)
        return default if e is None else e.value

    def pick(self, names: FrozenSet[bytes]) -> Dict[bytes, TableField]:
        """The first entry of each of these names that the table has: one pass over it."""
        out: Dict[bytes, TableField] = {}
        for e in self.entries:
            if e.name in names and e.name not in out:
                out[e.name] = e
        return out

    def __contains__(self, name: Name) -> bool:
        return self.find(name) is not None

    def __len__(self) -> int:
        return len(self.entries) + (1 if self.tail else 0)

    def names(self) -> List[Name]:
        return [_name(e.name) for e in self.entries]

    def without(self, drop: Callable[[Name], bool]) -> "Table":
        """The table without the entries whose (decoded) name `drop(name)` is true."""
        kept = [e for e in self.entries if not drop(_name(e.name))]
        return self if len(kept) == len(self.entries) else Table(kept, self.tail)

    def without_raw(self, drop: Callable[[bytes], bool]) -> "Table":
        """The same, `drop` asked of each name's bytes (no decoding: for every message read)."""
        kept = [e for e in self.entries if not drop(e.name)]
        return self if len(kept) == len(self.entries) else Table(kept, self.tail)

    def with_entry(self, entry: TableField) -> "Table":
        """`entry` last, in place of any entry of the same name."""
        return Table([e for e in self.entries if e.name != entry.name] + [entry], self.tail)

    def to_dict(self) -> Dict[Name, Any]:
        out = {_name(e.name): e.value for e in self.entries}
        if self.tail:
            out[b""] = Opaque(b"?", self.tail)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Table) and self.encode() == other.encode()

    def __repr__(self) -> str:
        return f"Table({self.to_dict()!r})"


# -- encoding the few value types the gateway writes itself --------------------------------
def long(name: Name, value: int) -> TableField:
    return TableField(_raw_name(name), b"l", struct.pack(">q", value))


def longstr(name: Name, value: Union[str, bytes]) -> TableField:
    raw = value if isinstance(value, bytes) else value.encode("utf-8")
    return TableField(_raw_name(name), b"S", struct.pack(">I", len(raw)) + raw)


def binary(name: Name, value: bytes) -> TableField:
    return TableField(_raw_name(name), b"x", struct.pack(">I", len(value)) + value)


def boolean(name: Name, value: bool) -> TableField:
    return TableField(_raw_name(name), b"t", b"\x01" if value else b"\x00")


def longstrs(name: Name, values: Sequence[bytes]) -> TableField:
    """An array of long strings."""
    items = b"".join(b"S" + struct.pack(">I", len(v)) + v for v in values)
    return TableField(_raw_name(name), b"A", struct.pack(">I", len(items)) + items)


def table(name: Name, value: "Table") -> TableField:
    """A nested field table."""
    return TableField(_raw_name(name), b"F", value.encode())


# -- content properties (class basic) --------------------------------------------------------
FIELDS = ("content_type", "content_encoding", "headers", "delivery_mode", "priority", "correlation_id",
          "reply_to", "expiration", "message_id", "timestamp", "type", "user_id", "app_id", "cluster_id")
_SHORTSTR = frozenset(FIELDS) - {"headers", "delivery_mode", "priority", "timestamp"}
_FLAG = {name: 1 << (15 - i) for i, name in enumerate(FIELDS)}


class Properties:
    """Basic content properties: each present field's value, and the exact bytes.

    Short strings are kept as bytes (they need not be UTF-8), octets and the timestamp as
    ints, headers as a Table.
    """

    __slots__ = ("raw", "_values")

    def __init__(self, raw: bytes, values: Optional[Dict[str, Any]] = None) -> None:
        self.raw = raw
        self._values = values

    @classmethod
    def parse(cls, raw: bytes) -> "Properties":
        """Never raises: bytes that are not properties at all keep only their raw form. The
        fields are read when first asked for: most messages only pass through."""
        return cls(bytes(raw))

    @property
    def values(self) -> Dict[str, Any]:
        if self._values is None:
            try:
                self._values = _parse_properties(self.raw)
            except (Malformed, struct.error, IndexError):
                self._values = {}
        return self._values

    @classmethod
    def build(cls, **values: Any) -> "Properties":
        """Properties with these fields (None: absent)."""
        values = {k: _normal(k, v) for k, v in values.items() if v is not None}
        return cls(_encode_properties(values), values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Properties) and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"Properties({self.raw!r})"

    @property
    def headers(self) -> Table:
        return self.values.get("headers") or Table()

    def get(self, field: str) -> Any:
        return self.values.get(field)

    def text(self, field: str) -> Optional[str]:
        """A short-string field for people to read (not UTF-8: shown with escapes)."""
        value = self.values.get(field)
        return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else value

    def replace(self, **changes: Any) -> "Properties":
        """These fields changed (None removes one); the bytes of the rest stay as they were."""
        if all(self.values.get(k) is None and v is None for k, v in changes.items()):
            return self
        values = dict(self.values)
        for k, v in changes.items():
            if v is None:
                values.pop(k, None)
            else:
                values[k] = _normal(k, v)
        return Properties(_encode_properties(values), values)


def _normal(field: str, value: Any) -> Any:
    """Short strings are kept as bytes."""
    if field not in FIELDS:
        raise ValueError(f"no property {field!r}")
    return value.encode("utf-8") if field in _SHORTSTR and isinstance(value, str) else value


# How each field is read, in flag order: a short string, the headers, the timestamp, an octet.
_SHORT, _HEADERS, _TIMESTAMP, _OCTET = range(4)
_READ = tuple((name, _FLAG[name], _SHORT if name in _SHORTSTR else _HEADERS if name == "headers"
               else _TIMESTAMP if name == "timestamp" else _OCTET) for name in FIELDS)
_WORD, _TABLE_LENGTH, _STAMP = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")


def _parse_properties(raw: bytes) -> Dict[str, Any]:
    raw = bytes(raw)
    flags, offset = 0, 0
    while True:  # flag words: the lowest bit says another follows
        word = _WORD.unpack_from(raw, offset)[0]
        offset += 2
        flags |= word << (16 * (offset // 2 - 1))
        if not word & 1:
            break
    values: Dict[str, Any] = {}
    for name, flag, how in _READ:
        if not flags & flag:
            continue
        if how == _SHORT:
            length = raw[offset]
            values[name] = raw[offset + 1:offset + 1 + length]
            offset += 1 + length
        elif how == _HEADERS:
            length = _TABLE_LENGTH.unpack_from(raw, offset)[0]
            values[name] = Table.parse(raw[offset + 4:offset + 4 + length])
            offset += 4 + length
        elif how == _TIMESTAMP:
            values[name] = _STAMP.unpack_from(raw, offset)[0]
            offset += 8
        else:
            values[name] = raw[offset]
            offset += 1
        if offset > len(raw):
            raise Malformed("truncated properties")
    return values


def _encode_properties(values: Dict[str, Any]) -> bytes:
    flags = 0
    pieces = [b""]
    for name in FIELDS:
        value = values.get(name)
        if value is None:
            continue
        flags |= _FLAG[name]
        if name in _SHORTSTR:
            raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
            if len(raw) > 255:
                raise ValueError(f"{name} is longer than 255 bytes")
            pieces.append(bytes([len(raw)]) + raw)
        elif name == "headers":
            pieces.append(value.encode())
        elif name == "timestamp":
            pieces.append(struct.pack(">Q", value))
        else:
            pieces.append(bytes([value]))
    pieces[0] = struct.pack(">H", flags)
    return b"".join(pieces)
