"""`python -m bench.rules`: what group cancels (rules) cost a gateway, pure (no broker): adding
10,000 from a cold start, the memory a rule holds, judging a message against 10,000 live rules
(wildcard-first patterns, and the worst a group canceller can pick: every rule in one index
bucket), and the topic matcher on the longest patterns and keys AMQP allows. Figures for
BENCHMARKS.md; the tests assert what is decided, never how long it takes."""

import argparse
import gc
import time
import timeit
import tracemalloc
from typing import Callable, List, Sequence

from gateway.core import cancels, rules
from gateway.core.selection import Selection, topic_pattern
from gateway.core.wire import Table

NOW = 1_800_000_000_000
T = NOW * 1000


def _rules(selections: Sequence[Selection]) -> List[rules.Rule]:
    return [rules.Rule(f"rule-{n}".encode(), s, cancels.Time(T + 1 + n)) for n, s in enumerate(selections)]


def _held(made: Sequence[rules.Rule]) -> rules.Rules:
    held = rules.Rules(window_ms=10**9)
    for r in made:
        held.add(r, NOW)
    return held


def _per_call_us(call: Callable[[], object], repeat: int = 7, number: int = 2000) -> float:
    return min(timeit.repeat(call, repeat=repeat, number=number)) / number * 1e6


def _judge(held: rules.Rules, key: bytes, mid: bytes, headers: Table, read_us: int = T) -> Callable[[], object]:
    taken_in = cancels.Time(read_us)
    return lambda: held.first(mid, key, NOW, False, lambda: headers, lambda: b"@x", read_us, taken_in)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rules", description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", type=int, default=rules.MAX_LIVE, help="live rules (default: the limit)")
    n = p.parse_args(argv).rules
    lines = []

    wildcard_first = [Selection(key=f"*.order-{i}.#") for i in range(n)]
    made = _rules(wildcard_first)
    gc.collect()
    started = time.perf_counter()
    held = _held(made)
    lines.append(f"add {n:,} wildcard-first rules from a cold start: {time.perf_counter() - started:.3f} s")

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    again = _held(_rules([Selection(key=f"*.order-{i}.#", due_before_ms=NOW + i) for i in range(n)]))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    lines.append(f"memory held per rule (record read back, indexed): {grown / n:,.0f} bytes ({len(again):,} rules)")

    headers = Table()
    lines.append(f"judge a message it selects ({n:,} wildcard-first rules live): "
                 f"{_per_call_us(_judge(held, b'eu.order-17.created', b'm-1', headers)):.1f} µs")
    lines.append(f"judge a message no rule selects, 8-word key: "
                 f"{_per_call_us(_judge(held, b'a.b.c.d.e.f.g.h', b'm-1', headers)):.1f} µs")
    long_key = b".".join([b"x"] * 127 + [b"order-5"])
    lines.append(f"judge a 255-byte key of 128 words: {_per_call_us(_judge(held, long_key, b'm-1', headers)):.1f} µs")

    # The worst a group canceller can build within the limits (Rules.room_for): every index an
    # 8-word message looks in full, with rules that it must match in full and that do not
    # select it (MAX_BROAD broad ones, MAX_SHARED in the bucket of each of its words), all older
    # than the message would be: nothing stops early.
    words = [f"w{i}" for i in range(8)]
    worst = [Selection(due_before_ms=NOW - 1 - i) for i in range(rules.MAX_BROAD)]
    for w in words:
        worst += [Selection(key=f"{w}.{'#.' * 20}nothing", due_after_ms=i) for i in range(rules.MAX_SHARED)]
    full = rules.Rules(window_ms=10**9)
    for r in _rules(worst):
        assert full.room_for(r.select) is None
        full.add(r, NOW)
    key = ".".join(words).encode()
    lines.append(f"judge an 8-word message against the worst {len(full):,} rules the limits allow "
                 f"({rules.MAX_BROAD} broad, {rules.MAX_SHARED} per word, 20 '#' each): "
                 f"{_per_call_us(_judge(full, key, b'm', headers), repeat=3, number=20):,.0f} µs; a message read "
                 f"after them (no rule can cancel it): "
                 f"{_per_call_us(_judge(full, key, b'm', headers, T + 10**9), repeat=3, number=20):,.0f} µs")

    for pattern, key in ((".".join(["#"] * 24 + ["z"]), b".".join([b"a"] * 8)),
                         (".".join(["#", "a"] * 64)[:255], b".".join([b"a"] * 128)),
                         (".".join(["*"] * 128), b".".join([b"a"] * 128))):
        match = topic_pattern(pattern)
        lines.append(f"topic pattern of {len(pattern)} bytes against a key of {len(key)}: "
                     f"{_per_call_us(lambda match=match, key=key: match(key)):.1f} µs")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
