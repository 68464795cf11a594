"""`delay-gateway example-orders OUT`: an orders table to try `schedule` with.

Each order was delivered about a week ago, so "remind the customer to review, 7 days after
delivery" falls due one to three minutes from now (time enough for Spark to start): run the printed command, and watch
them arrive with `record`. A few rows are broken on purpose (an unreadable delivery time,
an order delivered months ago) to show the errors output.
"""

import argparse
import csv
import json
import random
import sys
from typing import Dict, List

from gateway.clock import wall_ms
from gateway.settings import Settings, UsageError
from gateway.times import iso_ms

PRODUCTS = ("kettle", "lamp", "backpack", "headphones", "teapot", "umbrella", "notebook", "chair")
DAY_MS = 24 * 3600 * 1000
WEEK_MS = 7 * DAY_MS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="file to write: .csv or .jsonl")
    p.add_argument("--rows", type=int, default=1000, help="orders (default 1000)")
    p.add_argument("--broken", type=int, default=5, help="of which broken on purpose (default 5)")
    p.add_argument("--after-s", type=int, default=60, metavar="SECONDS",
                   help="reminders fall due from this many seconds from now (default 60) ...")
    p.add_argument("--within-s", type=int, default=120, metavar="SECONDS",
                   help="... over this many seconds (default 120)")
    p.add_argument("--seed", type=int, default=7)


def orders(n: int, broken: int, after_ms: int, within_ms: int, now_ms: int, seed: int) -> List[Dict[str, str]]:
    """Pure: the rows. delivered_at is an ISO timestamp (UTC) one week before the reminder."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        due = now_ms + after_ms + rng.randint(0, max(0, within_ms))
        delivered_ms = due - WEEK_MS
        row = {"order_id": f"order-{i:06d}", "customer": f"customer-{rng.randint(1, n // 3 + 1):05d}",
               "product": rng.choice(PRODUCTS), "delivered_at": iso_ms(delivered_ms)}
        if i < broken:  # spread the two kinds of broken rows over the first ones
            row["delivered_at"] = "soon" if i % 2 == 0 else iso_ms(delivered_ms - 90 * DAY_MS)
        out.append(row)
    rng.shuffle(out)
    return out


def run(settings: Settings, out: str, rows: int, broken: int, after_s: int, within_s: int, seed: int) -> int:
    """`delay-gateway example-orders` (of the settings, only the log's, set up before it runs)."""
    if rows < 1 or not 0 <= broken <= rows:
        raise UsageError("--rows must be at least 1 and --broken between 0 and --rows")
    if after_s < 0 or within_s < 0:
        raise UsageError("--after-s and --within-s cannot be negative")
    table = orders(rows, broken, after_s * 1000, within_s * 1000, wall_ms(), seed)
    if out.endswith(".csv"):
        with open(out, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    elif out.endswith((".jsonl", ".json", ".ndjson")):
        with open(out, "w", encoding="utf-8") as f:
            for row in table:
                f.write(json.dumps(row) + "\n")
    else:
        raise UsageError(f"{out}: write .csv or .jsonl")
    print(f"wrote {len(table)} orders ({broken} broken on purpose) to {out}; schedule their review "
          "reminders, 7 days after delivery, with:\n\n"
          f"  delay-gateway schedule {out} --routing-key reminder.review --payload-row \\\n"
          "      --message-id-column order_id --due-expr \"to_timestamp(delivered_at) + INTERVAL 7 DAYS\"\n\n"
          "and watch them arrive with:  delay-gateway record --routing-key-pattern 'reminder.#'",
          file=sys.stderr)
    return 0
