"""The delayed-message plugin's waiting messages, read and removed through `rabbitmqctl eval`.

The plugin (rabbitmq-delayed-message-exchange) keeps what waits in Mnesia, one pair of
tables per node that took publishes: `rabbit_delayed_message<node>`, a bag of
`{delay_entry, {delay_key, DueMs, Exchange}, Message, Ref}`, and
`rabbit_delayed_message<node>_index`, an ordered set of `{delay_index, Key, true}` that its
timer walks in due order. Nothing but Erlang on a broker node reaches them, so each step is
a small Erlang program run by the broker's own CLI; every value it prints is base64, one
message a line, so nothing here parses Erlang terms.

Shapes read (anything else is refused, not guessed at): the message as a `#delivery{}`
holding a `#basic_message{}` (RabbitMQ 3.10-3.12) or as a message container (`mc`, 3.13 and
4.x, converted to AMQP 0.9.1 by the broker's own `mc:convert`). The properties come out as
the broker encodes them on delivery, the body as its bytes: what the plugin would have
delivered, but for its `x-delay`.

Removal is one Mnesia transaction per REFS_PER_REMOVE entries, each found by its due time
and unique reference (an entry already gone, e.g. delivered by the plugin, is not counted).
"""

import base64
import re
import subprocess
from dataclasses import dataclass
from string import Template
from typing import Dict, List, Optional, Sequence, Tuple

# The table's shape, as `mnesia:table_info` prints it (~w): the plugin's versions 3.8-4.x.
ENTRY_SHAPE = ("delay_entry", "[delay_key,delivery,ref]", "bag")
INDEX_SHAPE = "[delay_key,const]"
PREFIX = "rabbit_delayed_message"

_TABLES = r"""
Tabs = case mnesia:system_info(is_running) of
    yes -> [T || T <- mnesia:system_info(tables), lists:prefix("$prefix", atom_to_list(T)),
                 not lists:suffix("_index", atom_to_list(T))];
    _ -> not_running
end,
"""

_PROBE = _TABLES + r"""
Vsn = case application:get_key(rabbitmq_delayed_message_exchange, vsn) of {ok, V} -> V; _ -> "-" end,
Khepri = try rabbit_khepri:is_enabled() of true -> "khepri"; _ -> "mnesia" catch _:_ -> "mnesia" end,
io:format("node\t~s\t~s\t~s~n", [node(), Vsn, Khepri]),
case Tabs of
    not_running -> io:format("mnesia\tnot running~n");
    _ -> lists:foreach(fun(T) ->
             I = list_to_atom(atom_to_list(T) ++ "_index"),
             io:format("table\t~s\t~w\t~w\t~w\t~w\t~w\t~w~n",
                       [T, mnesia:table_info(T, where_to_read), mnesia:table_info(T, record_name),
                        mnesia:table_info(T, attributes), mnesia:table_info(T, type),
                        mnesia:table_info(T, size), catch mnesia:table_info(I, attributes)])
         end, Tabs)
end,
ok.
"""

# Shared by the programs that read entries: the exchange's name, the message, its parts.
_READ = r"""
T = list_to_atom(binary_to_list(base64:decode(<<"$table">>))),
I = list_to_atom(atom_to_list(T) ++ "_index"),
XName = fun(X) when element(1, X) =:= exchange -> element(2, X); (X) -> X end,
B64 = fun(Bin) -> base64:encode(Bin) end,
Parts = fun(D) ->
    M = case element(1, D) of delivery -> element(5, D); _ -> D end,
    {Rk, C0} = case element(1, M) of
        basic_message -> {hd(element(3, M)), element(4, M)};
        mc -> M2 = mc:convert(mc_amqpl, M), {hd(mc:routing_keys(M2)), mc:protocol_state(M2)}
    end,
    content = element(1, C0),
    C = rabbit_binary_generator:ensure_content_encoded(C0, rabbit_framing_amqp_0_9_1),
    {Rk, element(4, C), iolist_to_binary(lists:reverse(element(6, C)))}
end,
"""

_KEYS = _READ + r"""
Walk = fun W(K = {delay_key, Due, X}) ->
               R = XName(X),
               io:format("key\t~b\t~s\t~s\t~b~n", [Due, B64(element(2, R)), B64(element(4, R)),
                                                  length(mnesia:dirty_read(T, K))]),
               W(mnesia:dirty_next(I, K));
           W(_) -> ok
       end,
Walk(mnesia:dirty_first(I)),
io:format("done~n").
"""

_BATCH = _READ + r"""
VHost = base64:decode(<<"$vhost">>),
Names = [base64:decode(N) || N <- [$names]],
Emit = fun(E) ->
    try
        {delay_entry, {delay_key, Due, _}, D, Ref} = E,
        {Rk, Props, Body} = Parts(D),
        io:format("entry\t~b\t~s\t~s\t~s\t~s~n", [Due, B64(Rk), B64(Props), B64(Body), B64(term_to_binary(Ref))])
    catch Class:Reason ->
        io:format("unknown\t~s~n", [B64(iolist_to_binary(io_lib:format("~P (~p:~P)", [E, 12, Class, Reason, 8])))]),
        throw(unknown_shape)
    end
end,
Walk = fun W(K = {delay_key, Due, X}, _, N) when N < $limit ->
               R = XName(X),
               Es = case Due >= $min_due andalso element(2, R) =:= VHost
                         andalso (Names =:= [] orelse lists:member(element(4, R), Names)) of
                   true -> mnesia:dirty_read(T, K);
                   false -> []
               end,
               lists:foreach(Emit, Es),
               W(mnesia:dirty_next(I, K), K, N + length(Es));
           W({delay_key, _, _}, Last, _) -> io:format("cursor\t~s~n", [B64(term_to_binary(Last))]);
           W(_, _, _) -> io:format("done~n")
       end,
Start = case <<"$cursor">> of
    <<>> -> mnesia:dirty_first(I);
    C -> mnesia:dirty_next(I, binary_to_term(base64:decode(C)))
end,
catch Walk(Start, none, 0).
"""

_REMOVE = r"""
T = list_to_atom(binary_to_list(base64:decode(<<"$table">>))),
I = list_to_atom(atom_to_list(T) ++ "_index"),
Refs = sets:from_list([binary_to_term(base64:decode(R)) || R <- [$refs]]),
Keys = fun W(K = {delay_key, Due, _}, Acc) when Due =< $last -> W(mnesia:dirty_next(I, K), [K | Acc]);
           W(_, Acc) -> Acc
       end,
{atomic, Removed} = mnesia:transaction(fun() ->
    lists:foldl(fun(K, Done) ->
        Es = [E || E <- mnesia:read(T, K, write), sets:is_element(element(4, E), Refs)],
        lists:foreach(fun(E) -> mnesia:delete_object(T, E, write) end, Es),
        case Es =/= [] andalso mnesia:read(T, K, read) =:= [] of true -> mnesia:delete(I, K, write); false -> ok end,
        Done + length(Es)
    end, 0, Keys(mnesia:dirty_next(I, {delay_key, $first, 0}), []))
end),
io:format("removed\t~b~n", [Removed]).
"""

# A command line's one argument holds at most 128 KiB on Linux (MAX_ARG_STRLEN); RabbitMQ
# 4's eval does not read its program from standard input (3.x does), so it goes there.
REFS_PER_REMOVE = 1500
SHELL_SAFE = re.compile(r"(?:[^$`\\]|\\[tn])*", re.S)  # no $ or `; a backslash only in \t and \n


class PluginError(RuntimeError):
    """One line: why the plugin's table cannot be read or changed. `refused`: the broker
    answered (no plugin, another shape: exit 3); else it could not be reached (exit 1)."""

    def __init__(self, message: str, refused: bool = True) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class MnesiaTable:
    """One of the plugin's tables in Mnesia, as the node describes it (not the AMQP field
    table of gateway/core/wire.py)."""

    name: str
    where: str  # the node holding it ('nowhere' when that node is down)
    record: str
    attributes: str
    type: str
    size: int
    index: str

    def problem(self) -> Optional[str]:
        """Why this is not a table of the plugin's shape, or None."""
        found = (self.record, self.attributes, self.type)
        if found != ENTRY_SHAPE or self.index != INDEX_SHAPE:
            return (f"table {self.name} is not of the shape this command reads (record {self.record} "
                    f"{self.attributes}, {self.type}, index {self.index}; expected {ENTRY_SHAPE[0]} "
                    f"{ENTRY_SHAPE[1]}, {ENTRY_SHAPE[2]}, index {INDEX_SHAPE}): another version of the plugin?")
        if self.where == "nowhere":
            return f"table {self.name} cannot be read: the node holding it is down"
        return None


@dataclass(frozen=True)
class Probe:
    node: str
    plugin_version: Optional[str]
    metadata_store: str  # 'mnesia' or 'khepri'
    mnesia_running: bool
    tables: Tuple[MnesiaTable, ...]


@dataclass(frozen=True)
class Waiting:
    """A key of the plugin's index: how many messages of one exchange fall due at one ms."""
    due_ms: int
    vhost: str
    exchange: str
    count: int


@dataclass(frozen=True)
class PluginMessage:
    """One message waiting in the plugin's table, as read from it."""
    due_ms: int
    routing_key: bytes
    properties: bytes  # AMQP 0.9.1 basic properties, as the broker encodes them
    body: bytes
    ref: str  # its unique reference (external term format, base64): what `remove` finds it by


class PluginTables:
    """The broker's CLI (`ctl`: the command line that runs rabbitmqctl for the node to use,
    e.g. ['rabbitmqctl', '-n', 'rabbit@host'] or ['kubectl', 'exec', '-i', 'rabbitmq-0', '--',
    'rabbitmqctl']), driven to read and remove the plugin's entries."""

    def __init__(self, ctl: Sequence[str], env: Optional[Dict[str, str]] = None, timeout_s: float = 300) -> None:
        self.ctl, self.env, self.timeout_s = list(ctl), env, timeout_s

    def run(self, program: str) -> List[List[str]]:
        """Run one Erlang program on the node; its lines, split at tabs. (The program is an
        argument: RabbitMQ 4's eval does not read standard input. Debian's rabbitmqctl
        wrapper passes it through `su -c "..."`, so it holds no $, ` or backslash-escaped
        quote: see SHELL_SAFE.)"""
        assert SHELL_SAFE.fullmatch(program), "a program the shell would change"
        try:
            result = subprocess.run([*self.ctl, "eval", program], capture_output=True,
                                    text=True, env=self.env, timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise PluginError(f"{self.ctl[0]} not found: give the command that runs rabbitmqctl for the "
                              "plugin's node with --rabbitmqctl", refused=False) from None
        except subprocess.TimeoutExpired:
            raise PluginError(f"{' '.join(self.ctl)} eval did not answer in {self.timeout_s:.0f} s",
                              refused=False) from None
        if result.returncode != 0:
            said = " ".join((result.stderr.strip() or result.stdout.strip()).split())[:400]
            raise PluginError(f"{' '.join(self.ctl)} eval failed (exit {result.returncode}): {said}",
                              refused=False)
        return [line.split("\t") for line in result.stdout.splitlines() if line]

    def probe(self) -> Probe:
        lines = self.run(Template(_PROBE).substitute(prefix=PREFIX))
        node = next((fields for fields in lines if fields[0] == "node"), None)
        if node is None:
            raise PluginError(f"{' '.join(self.ctl)} eval printed nothing this command understands", False)
        tables = tuple(MnesiaTable(f[1], f[2], f[3], f[4], f[5], int(f[6]), f[7]) for f in lines if f[0] == "table")
        return Probe(node[1], None if node[2] == "-" else node[2], node[3],
                     not any(f[0] == "mnesia" for f in lines), tables)

    def keys(self, table: str) -> List[Waiting]:
        """Every key of a table in due order (no bodies: what --dry-run counts)."""
        lines = self.run(Template(_KEYS).substitute(table=_b64(table.encode())))
        _finished(lines, table)
        return [Waiting(int(f[1]), _text(f[2]), _text(f[3]), int(f[4])) for f in lines if f[0] == "key"]

    def batch(self, table: str, vhost: str, exchanges: Sequence[str], min_due_ms: int, limit: int,
              cursor: str = "") -> Tuple[List[PluginMessage], Optional[str]]:
        """Up to about `limit` entries (whole keys) of this vhost's exchanges (all when
        `exchanges` is empty) due at `min_due_ms` or later, after `cursor`, in due order;
        and the cursor to go on from (None: the table's end)."""
        names = ",".join(f'<<"{_b64(n.encode())}">>' for n in exchanges)
        lines = self.run(Template(_BATCH).substitute(
            table=_b64(table.encode()), vhost=_b64(vhost.encode()), names=names, min_due=int(min_due_ms),
            limit=int(limit), cursor=cursor))
        for f in lines:
            if f[0] == "unknown":
                raise PluginError(f"an entry of table {table} is of a shape this command does not read, so "
                                  f"nothing more was moved: {_text(f[1])}")
        _finished(lines, table, ("done", "cursor"))
        entries = [PluginMessage(int(f[1]), _bytes(f[2]), _bytes(f[3]), _bytes(f[4]), f[5])
                   for f in lines if f[0] == "entry"]
        after = next((f[1] for f in lines if f[0] == "cursor"), None)
        return entries, after

    def remove(self, table: str, entries: Sequence[PluginMessage]) -> int:
        """Remove these entries (found by due time and reference), a transaction per
        REFS_PER_REMOVE; how many were still there."""
        removed = 0
        for start in range(0, len(entries), REFS_PER_REMOVE):
            part = entries[start:start + REFS_PER_REMOVE]
            lines = self.run(Template(_REMOVE).substitute(
                table=_b64(table.encode()), refs=",".join(f'<<"{e.ref}">>' for e in part),
                first=min(e.due_ms for e in part), last=max(e.due_ms for e in part)))
            done = next((f for f in lines if f[0] == "removed"), None)
            if done is None:
                raise PluginError(f"removing moved entries from {table}: the broker's CLI printed no result; "
                                  "run again (entries still in the table are moved again: duplicates)", False)
            removed += int(done[1])
        return removed


def _finished(lines: List[List[str]], table: str, ends: Tuple[str, ...] = ("done",)) -> None:
    if not any(f[0] in ends for f in lines):
        raise PluginError(f"reading {table}: the program stopped before the end of the table "
                          f"(it printed: {' | '.join(chr(9).join(f) for f in lines[-3:])[:300]})", False)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes(text: str) -> bytes:
    return base64.b64decode(text)


def _text(text: str) -> str:
    return _bytes(text).decode("utf-8", "backslashreplace")
