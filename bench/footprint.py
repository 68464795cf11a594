"""`footprint`: what one prefix's chain costs the broker at rest, per prefix.

Declares `--footprint-prefixes` chains (the gateway's own declare, each with a prefix of its
own, for every --queue-types x --zero-bits), and compares the broker before and after,
each at rest over `--idle-window` seconds: queues by type, exchanges, bindings (but the
default exchange's); on 3.x the file-handle reservations that wedge a node when they reach
the open-files limit less 97 (docs/operating.md); open descriptors; Erlang processes;
memory; CPU. Every node of a
cluster is asked (one `rabbitmqctl eval` on the URL's node reaches the others), so the
figures of three nodes are their sums. The chains are deleted afterwards, also when the
run fails. No gateway runs: this is what the declared objects alone cost.
"""

import re
import time
from typing import Dict, List, Optional

from topology import build
from topology.broker.declare import declare, delete

from .clients import blocking
from .context import Context

# One eval on the URL's node, summed over every running node of its cluster. A figure a
# version lacks reads -1: 4.x has no file-handle bookkeeping (file_handle_cache is gone).
_AT_REST = r"""
Ns = [node() | nodes()],
Call = fun(M, F, A) -> [R || R <- element(1, rpc:multicall(Ns, M, F, A, 30000)), not is_tuple(R) orelse
                                                                                   element(1, R) =/= badrpc] end,
Sum = fun(L) -> lists:sum([X || X <- L, is_integer(X)]) end,
Fhc = case code:which(file_handle_cache) of
        non_existing -> [];
        _ -> Call(file_handle_cache, info, [[total_used, total_limit]])
      end,
Fh = case Fhc of [] -> -1; _ -> Sum([proplists:get_value(total_used, I, 0) || I <- Fhc]) end,
FhLimit = case Fhc of [] -> -1; _ -> lists:min([proplists:get_value(total_limit, I, 0) || I <- Fhc]) end,
Fds = Sum([length(element(2, file:list_dir("/proc/" ++ P ++ "/fd"))) || P <- Call(os, getpid, [])]),
Qs = rabbit_amqqueue:list(),
Type = fun(Q) -> case amqqueue:get_type(Q) of rabbit_quorum_queue -> quorum; rabbit_stream_queue -> stream;
                   _ -> classic end end,
Count = fun(T) -> length([Q || Q <- Qs, Type(Q) =:= T]) end,
[{nodes, length(Ns)}, {quorum, Count(quorum)}, {stream, Count(stream)}, {classic, Count(classic)},
 {exchanges, length(rabbit_exchange:list())},
 {bindings, length([B || B <- rabbit_binding:list(<<"/">>), element(4, element(2, B)) =/= <<>>])},
 {file_handles, Fh}, {file_handle_limit, FhLimit}, {open_fds, Fds},
 {processes, Sum(Call(erlang, system_info, [process_count]))},
 {memory, Sum(Call(erlang, memory, [total]))},
 {cpu_ms, Sum([element(1, R) || R <- Call(erlang, statistics, [runtime])])}].
"""


def at_rest(ctx: Context) -> Optional[Dict[str, int]]:
    out = ctx.broker.ctl("eval", " ".join(_AT_REST.split()))
    if out is None:
        return None
    return {k: int(v) for k, v in re.findall(r"\{(\w+),(-?\d+)\}", out)} or None


def measured(ctx: Context, window_s: float) -> Optional[Dict[str, float]]:
    """The broker's figures at rest, its CPU (% of one core, all nodes) over `window_s`."""
    first = at_rest(ctx)
    time.sleep(window_s)
    last = at_rest(ctx)
    if first is None or last is None:
        return None
    out: Dict[str, float] = dict(last)
    out["cpu_pct"] = (last["cpu_ms"] - first["cpu_ms"]) / 10 / window_s
    return out


PER_PREFIX = ("quorum", "stream", "classic", "exchanges", "bindings", "file_handles", "open_fds", "processes")


def footprint(ctx: Context) -> List[dict]:
    """Per prefix, for each queue type x zero-bits mode: objects, handles, processes, memory
    and CPU at rest that `--footprint-prefixes` chains add to the broker (default 5)."""
    count = int(ctx.extra.get("footprint_prefixes") or 5)
    window = float(ctx.extra.get("idle_window") or 60.0)
    if ctx.broker.rabbitmqctl is None:
        raise SystemExit("bench footprint: it asks the broker with rabbitmqctl eval: drop --rabbitmqctl none")
    out = []
    for queue_type, zero_bits in ctx.topologies():
        before = measured(ctx, window)
        if before is None:
            raise SystemExit(f"bench footprint: `{' '.join(ctx.broker.rabbitmqctl)} eval` gave no answer: "
                             "name the node's rabbitmqctl with --rabbitmqctl")
        topologies = [build(ctx.chain("footprint", queue_type, zero_bits)) for _ in range(count)]
        declared = []
        try:
            t0 = time.monotonic()
            with blocking(ctx.url, "delay-gateway bench footprint") as c:
                channel = c.channel()
                for topology in topologies:
                    declared.append(topology)
                    declare(channel, topology)
            declare_s = time.monotonic() - t0
            after = measured(ctx, window)
        finally:
            with blocking(ctx.url, "delay-gateway bench footprint") as c:
                for topology in declared:
                    delete(c.channel(), topology)
        if after is None:
            raise SystemExit("bench footprint: the broker stopped answering rabbitmqctl eval")
        model = topologies[0]
        r: dict = {"scenario": "footprint", "queue_type": queue_type, "zero_bits": zero_bits,
                   "nodes": int(after["nodes"]), "prefixes": count, "window_s": window,
                   "declare_s_per_prefix": round(declare_s / count, 2),
                   "model": {"queues": len(model.queues), "exchanges": len(model.exchanges),
                             "bindings": len(model.bindings)},
                   "file_handle_limit": int(after["file_handle_limit"]),
                   "before": before, "after": after}
        for k in PER_PREFIX:
            if before[k] < 0:
                r[k] = None
            else:
                r[k] = round((after[k] - before[k]) / count, 1)
        r["memory_mib"] = round((after["memory"] - before["memory"]) / count / 2**20, 2)
        r["cpu_pct"] = round((after["cpu_pct"] - before["cpu_pct"]) / count, 2)
        r["prefixes_the_limit_holds"] = None
        if r["file_handles"]:
            # what a node holds before 3.x's bookkeeping wedges it: the budget less what is
            # reserved before any prefix (the nodes of a cluster each reserve their share)
            budget = after["file_handle_limit"] * r["nodes"] - before["file_handles"]
            r["prefixes_the_limit_holds"] = int(budget // r["file_handles"])
        ctx.log(f"  footprint {queue_type}/{zero_bits} on {r['nodes']} node(s), per prefix: "
                f"{r['quorum']} quorum, {r['stream']} streams, {r['classic']} classic, {r['exchanges']} exchanges, "
                f"{r['bindings']} bindings, {r['file_handles']} file handles, {r['open_fds']} fds, "
                f"{r['processes']} processes, {r['memory_mib']} MiB, {r['cpu_pct']} % of a core at rest")
        out.append(r)
    return out
