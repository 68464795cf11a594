"""How fast each target goes: the highest rate at which it keeps p99 lateness under a limit,
nothing lost or early; `steady` climbs a ladder of rates target after target, `ceiling`
climbs rising rates with the targets side by side."""

from typing import Dict, List, Optional, Sequence

from .context import Context, gateway_targets
from .delayed import Load, delayed_run, schedule
from .systems import DELAY, Target


def steady(ctx: Context, limit_ms: float = 100.0) -> List[dict]:
    """A ladder of rates (delays 1-30 s): the highest rate each target keeps p99 < limit."""
    lo, hi = ctx.delays(1_000, 30_000)
    out = []
    targets = ([Target("plugin", DELAY)] if ctx.plugin else []) + gateway_targets(ctx, (DELAY,))
    for target in targets:
        best = None
        for rate in ctx.rates:
            n = ctx.n(int(rate * ctx.duration_s))
            r = delayed_run(ctx, Load("steady", n, (lo, hi), rate=rate), target)
            ok = (r.get("p99_ms", 1e9) < limit_ms and r["lost"] == 0 and r["early"] == 0
                  and r["publish_rate"] >= 0.95 * rate)
            r["meets_p99_limit"], r["p99_limit_ms"] = ok, limit_ms
            out.append(r)
            if not ok:
                break
            best = rate
        for r in out:
            if r["label"] == target.label:
                r["best_rate"] = best
    return out


def ceiling(ctx: Context, limit_ms: float = 100.0) -> List[dict]:
    """Rising paced rates (`ceiling_rates`, delays 2-4 s, `ceiling_seconds` each), the plugin
    or kombu's chain and the gateway side by side at each rate: the highest rate each
    sustains with p99 under `limit_ms`, nothing lost or early. A target that misses at one
    rate is not tried at the next."""
    lo, hi = ctx.delays(2_000, 4_000)
    rates: Sequence[int] = ctx.extra.get("ceiling_rates") or (1000, 2000, 3000, 4500, 6000)  # type: ignore[assignment]
    seconds = float(ctx.extra.get("ceiling_seconds") or 10.0)  # type: ignore[arg-type]
    targets = [t for _, t in schedule(gateway_targets(ctx, (DELAY,)), 1, ctx.plugin, ctx.kombu)]
    alive = list(targets)
    out: List[dict] = []
    best: Dict[str, Optional[int]] = {t.label: None for t in targets}
    for rate in rates:
        for target in list(alive):
            r = delayed_run(ctx, Load("ceiling", ctx.n(int(rate * seconds)), (lo, hi), rate=rate), target)
            ok = (r.get("p99_ms", 1e9) < limit_ms and r["lost"] == 0 and r["early"] == 0
                  and r["publish_rate"] >= 0.95 * rate)
            r["meets_p99_limit"], r["p99_limit_ms"] = ok, limit_ms
            out.append(r)
            if ok:
                best[target.label] = rate
            else:
                alive.remove(target)
        if not alive:
            break
    for r in out:
        r["best_rate"] = best[r["label"]]
    return out
