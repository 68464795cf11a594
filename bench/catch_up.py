"""The `catch-up` scenario: an outage of the distributors, then their return, released at
once and with `--catch-up-rate`, side by side.

Per round and per rate (0: at once, the default; then `--catch-up-rate`): a check-in
process alone takes `--messages` (20,000) messages published evenly over
`--outage-seconds` (60), each due 1-3 s after its publish, so that all fall due during the
outage and wait in the distributor queue. Then a distributor process starts with that rate
while a publisher sends on-time messages (100 msg/s, due in 2-5 s) for as long as the
catch-up should last and 5 s more. A separate receiver takes everything from a quorum queue
bound to pick-up: the overdue messages' lateness and the rate they came at (their peak
second), and the on-time messages' lateness beside them."""

import random
import threading
import time
from typing import List

import pika

from topology import build
from topology.broker.declare import declare, delete

from tests.launcher import GatewayProcess

from .clients import Publisher, Receiver, blocking, body, declare_receiver_queue, delete_queue, now_ms
from .context import Context
from .stats import lateness_stats, per_second
from .systems import DELAY, headers_for

ON_TIME_RATE = 100.0


def catch_up(ctx: Context) -> List[dict]:
    overdue = ctx.n(20_000)
    outage_s = float(ctx.extra.get("outage_seconds") or 60.0)
    paced = float(ctx.extra.get("catch_up_rate") or 2000.0)
    out = []
    for round_no in range(1, ctx.rounds + 1):
        for rate in (0.0, paced):
            out.append(_run(ctx, round_no, overdue, outage_s, rate))
    return out


def _run(ctx: Context, round_no: int, overdue: int, outage_s: float, rate: float) -> dict:
    chain = ctx.chain("catch-up", ctx.queue_types[0], ctx.zero_bits[0])
    sink = f"{chain.prefix}.receiver"
    topology = build(chain)
    with blocking(ctx.url) as c:
        declare(c.channel(), topology)
    # the on-time flow lasts as long as the catch-up should, and five seconds more (at most the
    # outage's length: a tiny run stays short)
    on_time = int(ON_TIME_RATE * ((overdue / rate if rate else 0.0) + min(5.0, outage_s)))
    gateways: List[GatewayProcess] = []
    try:
        declare_receiver_queue(ctx.url, sink, ctx.receiver_queue_type, chain.names.pick_up)
        receiver = Receiver(ctx.url, sink, ctx.out_dir, overdue + on_time)
        check_in = GatewayProcess(chain, "--role", "check-in", *ctx.gateway_args, url=ctx.url, die_with_parent=True)
        gateways.append(check_in.wait_ready(60))
        rnd = random.Random(round_no)

        def make(first: int, lo: int, hi: int):
            def one(i: int):
                headers, due = headers_for(DELAY, now_ms(), rnd.randint(lo, hi))
                return (chain.names.check_in, f"bench.{i % 10}", pika.BasicProperties(delivery_mode=2,
                                                                                     headers=headers),
                        body(first + i, due, ctx.size), due)
            return one

        ctx.log(f"  catch-up round {round_no}, rate {rate or 'at once'}: an outage of {outage_s:.0f} s, "
                f"{overdue} falling due in it")
        outage = Publisher(ctx.url, overdue, make(0, 1000, 3000), rate=overdue / outage_s).run()
        back_at = max(outage.due) + 2000  # every one overdue by then
        time.sleep(max(0.0, (back_at - now_ms()) / 1000))  # (the outage itself: what the scenario measures)
        flow = Publisher(ctx.url, on_time, make(overdue, 2000, 5000), rate=ON_TIME_RATE)
        publishing = threading.Thread(target=flow.run, daemon=True)
        args = ["--role", "distributor", "--catch-up-rate", f"{rate:g}", *ctx.gateway_args]
        distributor = GatewayProcess(chain, *args, url=ctx.url, die_with_parent=True)
        gateways.append(distributor)
        returned_ms = now_ms()
        distributor.wait_ready(60)
        publishing.start()
        publishing.join(on_time / ON_TIME_RATE + 120)
        receiver.wait(overdue / (rate or 5000) + 120)
        data = receiver.stop()
    finally:
        for g in gateways:
            g.terminate(30)
        try:
            with blocking(ctx.url) as c:
                delete(c.channel(), topology)
        except pika.exceptions.AMQPError:
            pass
        delete_queue(ctx.url, sink)
    late = {k: [] for k in ("id", "due", "recv")}
    timely = {k: [] for k in ("id", "due", "recv")}
    for i, due, recv in zip(data["id"], data["due"], data["recv"], strict=True):
        part = late if i < overdue else timely
        part["id"].append(i)
        part["due"].append(due)
        part["recv"].append(recv)
    seconds = per_second([t / 1000 for t in late["recv"]], returned_ms / 1000)
    r = {"scenario": "catch-up", "round": round_no, "rate": rate, "outage_s": outage_s,
         "overdue": lateness_stats(late, overdue), "on_time": lateness_stats(timely, flow.acked),
         # from the distributor's start to the last overdue message at pick-up
         "catch_up_s": round((max(late["recv"]) - returned_ms) / 1000, 2) if late["recv"] else None,
         "peak_per_s": max(seconds, default=0)}
    ctx.log(f"    overdue: {r['overdue'].get('p99_ms')} ms p99, {r['catch_up_s']} s to catch up, peak "
            f"{r['peak_per_s']}/s; on time: p50 {r['on_time'].get('p50_ms')} / p99 {r['on_time'].get('p99_ms')} ms; "
            f"lost {r['overdue']['lost'] + r['on_time']['lost']}, early "
            f"{r['overdue']['early'] + r['on_time']['early']}")
    return r
