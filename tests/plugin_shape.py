"""Tables of the delayed-message plugin's shape on a private node, built by the broker's own
functions (the plugin is in no registry and never in this repository).

`fill` writes what the plugin writes for a publish to an `x-delayed-message` exchange: an
entry `{delay_entry, {delay_key, DueMs, Exchange}, Message, make_ref()}` in
`rabbit_delayed_message<node>` (a bag) and `{delay_index, Key, true}` in its `_index` (an
ordered set), both disc copies on that node. The message is the broker's own: a
`#delivery{}` of `rabbit_basic:message/3` on 3.10; on 4.x the message container that
function returns, every other one wrapped in a `#delivery{}` (which of the two the plugin's
4.x versions store was not checked against the plugin itself: the command reads both).
The exchange in the key is a plain topic exchange the test declares (an
`x-delayed-message` one needs the plugin).
"""

import base64
from typing import Callable, Sequence, Tuple

# (due ms, template number, routing key) per message; the templates are encoded properties.
Message = Tuple[int, int, str]

_CREATE = r"""
T = list_to_atom("rabbit_delayed_message" ++ atom_to_list(node())),
I = list_to_atom(atom_to_list(T) ++ "_index"),
Made = [mnesia:create_table(T, [{record_name, delay_entry}, {attributes, [delay_key, delivery, ref]},
                                {type, bag}, {disc_copies, [node()]}]),
        mnesia:create_table(I, [{record_name, delay_index}, {attributes, [delay_key, const]},
                                {type, ordered_set}, {disc_copies, [node()]}])],
io:format("~p~n", [Made]).
"""

_FILL = r"""
T = list_to_atom("rabbit_delayed_message" ++ atom_to_list(node())),
I = list_to_atom(atom_to_list(T) ++ "_index"),
X = rabbit_exchange:lookup_or_die(rabbit_misc:r(base64:decode(<<"VHOST">>), exchange, base64:decode(<<"EXCHANGE">>))),
Templates = list_to_tuple([base64:decode(P) || P <- [TEMPLATES]]),
Make = fun({N, Due, Template, Key}) ->
    Id = iolist_to_binary(["m-", integer_to_list(N)]),
    Bin = element(Template + 1, Templates),
    C0 = rabbit_binary_parser:ensure_content_decoded(
           {content, 60, none, Bin, rabbit_framing_amqp_0_9_1, [<<"body-", Id/binary>>]}),
    C = setelement(4, setelement(3, C0, setelement(10, element(3, C0), Id)), none),
    {ok, Msg} = rabbit_basic:message(element(2, X), base64:decode(Key), C),
    Stored = case erlang:function_exported(rabbit_basic, delivery, 4)
                  andalso (element(1, Msg) =/= mc orelse N rem 2 =:= 0) of
        true -> rabbit_basic:delivery(false, false, Msg, undefined);
        false -> Msg
    end,
    K = {delay_key, Due, X},
    ok = mnesia:dirty_write(T, {delay_entry, K, Stored, make_ref()}),
    ok = mnesia:dirty_write(I, {delay_index, K, true})
end,
lists:foreach(Make, [MESSAGES]),
io:format("size ~b~n", [mnesia:table_info(T, size)]).
"""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def create(ctl: Callable[[str], str]) -> str:
    """Create the node's two tables; `ctl(program)` runs `rabbitmqctl eval` and returns stdout."""
    return ctl(_CREATE)


def fill(ctl: Callable[[str], str], vhost: str, exchange: str, templates: Sequence[bytes],
         messages: Sequence[Message], first_id: int = 0, chunk: int = 2000) -> None:
    """Entries for `messages`, message ids m-<first_id + i>, bodies body-m-<...>."""
    for start in range(0, len(messages), chunk):
        part = ",".join(f'{{{first_id + start + i},{due},{template},<<"{_b64(key.encode())}">>}}'
                        for i, (due, template, key) in enumerate(messages[start:start + chunk]))
        program = (_FILL.replace("VHOST", _b64(vhost.encode())).replace("EXCHANGE", _b64(exchange.encode()))
                   .replace("TEMPLATES", ",".join(f'<<"{_b64(t)}">>' for t in templates))
                   .replace("MESSAGES", part))
        out = ctl(program)
        assert "size" in out, out
