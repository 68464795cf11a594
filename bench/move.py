"""The `move` scenario: what waits in one cluster moved to another with `delay-gateway move`,
as a blue-green upgrade does (the old cluster `--url`, the new one `--to-url`: 3.10.8 and
4.3.6 in BENCHMARKS.md).

A gateway on the old cluster takes `--messages` (1,000,000) published as fast as it reads
them, each due at a time spread evenly over `--spread-seconds` (900) that start
`--wait-seconds` (600) after the first publish, and one in a hundred due within a minute of
their publish (within --wait-seconds): those fall due during the move. The old gateway keeps
running while `move` takes everything from the old cluster's queues to the new one's; then a
gateway starts on the new cluster.
Receivers bound to pick-up on both clusters take everything (what the old gateway holds in
memory when the move reaches its queue is delivered there, once): lateness is measured on the
publisher's clock over the first arrival of each message, from both; duplicates and losses
over both."""

import json
import random
import subprocess
import sys
import time
from typing import List

import pika

from topology import build
from topology.broker.declare import declare, delete

from tests.launcher import ROOT, GatewayProcess, chain_args

from .clients import Publisher, Receiver, blocking, body, declare_receiver_queue, delete_queue, now_ms, queue_depth
from .context import Context
from .stats import lateness_stats
from .systems import DELIVER_AT, headers_for

SOON = 100  # one in this many is due within a minute: during the move


def move(ctx: Context) -> List[dict]:
    to_url = str(ctx.extra.get("to_url") or "")
    if not to_url:
        raise SystemExit("bench move: give the new cluster with --to-url URL")
    return [_run(ctx, round_no, to_url) for round_no in range(1, ctx.rounds + 1)]


def _run(ctx: Context, round_no: int, to_url: str) -> dict:
    n = ctx.n(1_000_000)
    wait_ms = float(ctx.extra.get("wait_seconds") or 600.0) * 1000
    spread_ms = float(ctx.extra.get("spread_seconds") or 900.0) * 1000
    chain = ctx.chain("move", ctx.queue_types[0], ctx.zero_bits[0])
    sink = f"{chain.prefix}.receiver"
    topology = build(chain)
    for url in (ctx.url, to_url):
        with blocking(url) as c:
            declare(c.channel(), topology)
        declare_receiver_queue(url, sink, ctx.receiver_queue_type, chain.names.pick_up)
    receivers = [Receiver(url, sink, ctx.out_dir, n) for url in (ctx.url, to_url)]
    gateways: List[GatewayProcess] = []
    try:
        old = GatewayProcess(chain, *ctx.gateway_args, url=ctx.url, die_with_parent=True)
        gateways.append(old.wait_ready(60))
        rnd = random.Random(round_no)
        start = now_ms()

        def one(i: int):
            soon = i % SOON == 0
            due = start + (rnd.uniform(5_000, min(60_000.0, wait_ms)) if soon else wait_ms + rnd.uniform(0, spread_ms))
            headers, due = headers_for(DELIVER_AT, now_ms(), max(0, int(due - now_ms())))
            return (chain.names.check_in, f"bench.{i % 10}", pika.BasicProperties(delivery_mode=2, headers=headers),
                    body(i, due, ctx.size), due)

        ctx.log(f"  move round {round_no}: {n:,} published to the old cluster")
        published = Publisher(ctx.url, n, one).run()
        ctx.log(f"    published in {published.seconds:.0f} s ({published.rate_achieved:,.0f}/s); waiting for the "
                "old check-in to read them all")
        while queue_depth(ctx.url, chain.names.check_in):
            time.sleep(1)  # (the old gateway reading them: what a user waits for too)
        ready_ms = now_ms()
        ctx.log(f"    all read by {(ready_ms - start) / 1000:.0f} s; moving")
        t0 = time.monotonic()
        moved = subprocess.run(
            [sys.executable, "-m", "gateway", "move", "--url", ctx.url, *chain_args(chain), "--to", to_url, "--json"],
            cwd=ROOT, capture_output=True, text=True, check=False)
        move_s = time.monotonic() - t0
        if moved.returncode:
            raise RuntimeError(f"move exited {moved.returncode}: {moved.stderr.strip().splitlines()[-1:]}")
        outcome = json.loads(moved.stdout)
        ctx.log(f"    moved {outcome['moved']:,} in {move_s:.1f} s ({outcome['moved'] / move_s:,.0f}/s), "
                f"{outcome['passes']} passes; the new gateway starts")
        if now_ms() > start + wait_ms:
            ctx.log("    (the move ended after the first of the far messages fell due: raise --wait-seconds)")
        gateways.append(GatewayProcess(chain, *ctx.gateway_args, url=to_url, die_with_parent=True).wait_ready(60))
        last_due = start + wait_ms + spread_ms
        # everything, and ten seconds past the last due time for duplicates; or ten minutes past it
        # (what comes later still is lost to the figures)
        while not (sum(r.count.value for r in receivers) >= n and now_ms() > last_due + 10_000) \
                and now_ms() < last_due + 600_000:
            time.sleep(2)
        data = [r.stop() for r in receivers]
    finally:
        for g in gateways:
            g.terminate(30)
        for url in (ctx.url, to_url):
            try:
                with blocking(url) as c:
                    delete(c.channel(), topology)
            except pika.exceptions.AMQPError:
                pass
            delete_queue(url, sink)
    every = {k: data[0][k] + data[1][k] for k in ("id", "due", "recv")}
    r = {"scenario": "move", "round": round_no, "messages": n, "publish_s": round(published.seconds, 1),
         "move_s": round(move_s, 1), "move_per_s": round(outcome["moved"] / move_s), "moved": outcome["moved"],
         "passes": outcome["passes"], "delivered_old": len(data[0]["id"]), "delivered_new": len(data[1]["id"]),
         "lateness": lateness_stats(every, published.acked)}
    late = r["lateness"]
    ctx.log(f"    delivered {r['delivered_old']:,} by the old cluster and {r['delivered_new']:,} by the new; lost "
            f"{late['lost']}, early {late['early']}, duplicates {late['duplicates']}; lateness p50 "
            f"{late.get('p50_ms')} / p99 {late.get('p99_ms')} ms")
    return r
