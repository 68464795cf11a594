"""What waits, exported by `delay-gateway pending export` and read on a real local Spark
with gateway.spark.pending.waiting: docs/spark.md's example (what falls due per routing
key per hour tomorrow), run as written, gives the counts the test published, from CSV and
from JSON lines."""

import os
import re
import subprocess
import sys

import pika
import pytest

from ..support import ROOT, broker_url, chain_args, connect, now_ms, wait_until

DAY_MS = 86_400_000


def the_docs_example() -> str:
    with open(os.path.join(ROOT, "docs", "spark.md"), encoding="utf-8") as f:
        section = f.read().split("## What waits, as a DataFrame", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.brokers("rmq3.10", reason="reading an export on Spark: the broker's version plays no part (the export "
                                       "itself is tested on every broker by tests/test_pending.py)")
def test_what_falls_due_per_routing_key_per_hour_tomorrow(spark, make_chain, run_gateway, tmp_path):
    chain = make_chain(max_level=3, resolution_ms=1000)  # (long delays lap meditation: listed all the same)
    run_gateway(chain)
    midnight = (now_ms() // DAY_MS + 1) * DAY_MS  # tomorrow, 00:00 UTC
    plan = {("orders.41.reminder", 9): 3, ("orders.42.reminder", 9): 2, ("orders.42.reminder", 17): 4,
            ("orders.43.reminder", 23): 1}
    with connect() as c:
        ch = c.channel()
        ch.confirm_delivery()
        for (key, hour), n in plan.items():
            for i in range(n):
                ch.basic_publish(chain.names.check_in, key, b"{}", pika.BasicProperties(
                    message_id=f"{key}-{hour}-{i}", headers={"x-deliver-at": midnight + hour * 3_600_000 + i * 1000}),
                    mandatory=True)
        ch.basic_publish(chain.names.check_in, "orders.42.reminder", b"{}", pika.BasicProperties(
            message_id="the-day-after", headers={"x-deliver-at": midnight + DAY_MS + 3_600_000}), mandatory=True)

    def exported(path: str) -> bool:
        out = subprocess.run([sys.executable, "-m", "gateway", "pending", "export", path, *chain_args(chain),
                              "--url", broker_url()], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stderr.startswith(f"exported {sum(plan.values()) + 1} ")
    zone = spark.conf.get("spark.sql.session.timeZone")
    try:
        for name in ("waiting.csv", "waiting.jsonl"):
            path = str(tmp_path / name)
            wait_until(lambda path=path: exported(path), 20, 0.3, f"{name}: every message exported")
            scope = {"spark": spark}
            exec(the_docs_example().replace('"waiting.jsonl"', repr(path)), scope)
            found = {(r["routing_key"], r["hour"]): r["count"] for r in scope["per_hour"].collect()}
            assert found == plan, (name, found)
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
