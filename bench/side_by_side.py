"""The side-by-side loads: paced, burst and at-once, each through every target (the gateway's
topologies and delay headers, and the plugin or kombu's chain when compared), alternating."""

from typing import List

from .context import Context
from .delayed import Load, compared


def paced(ctx: Context) -> List[dict]:
    """1,000 msg/s, delays 2-10 s, 20,000 messages."""
    rate = ctx.rate or 1000.0
    return compared(ctx, Load("paced", ctx.n(20_000), ctx.delays(2_000, 10_000), rate=rate))


def burst(ctx: Context) -> List[dict]:
    """20,000 published as fast as confirms allow, each with a delay of 5 s."""
    return compared(ctx, Load("burst", ctx.n(20_000), ctx.delays(5_000, 5_000)))


def at_once(ctx: Context) -> List[dict]:
    """100,000 due at the same instant, `at_once_ms` after publishing starts ("everyone gets
    the reminder at 9:00"): with x-delay each message says how long until then."""
    return compared(ctx, Load("at-once", ctx.n(100_000), (ctx.at_once_ms, ctx.at_once_ms),
                              at_once_ms=ctx.at_once_ms))
