"""A task of the `schedule` job, on an executor: a partition's rows turned into messages (their
due time fixed as they are published) and published with confirms."""

import functools
from typing import Optional

from gateway.clock import wall_ms
from gateway.spark import rows
from gateway.spark.publisher import Target


def publish_partition(target: Target, content_type: Optional[str], items):
    """One Spark task: publish a partition's rows, return [(rows confirmed, seconds)]."""
    from gateway.spark.publisher import PartitionPublisher
    make = functools.partial(outgoing, content_type)
    result = PartitionPublisher(target, iter(items), make).run()
    return [(result.rows, result.seconds)]


def outgoing(content_type: Optional[str], row):
    """A row of the publishing DataFrame as (routing key, body, properties), due time fixed now."""
    import pika
    # Unpacked by position: a Row's by-name access costs more than the rest of this function.
    routing_key, body, message_id, deliver_at_ms, delay_ms, headers = row
    now = wall_ms()
    due = deliver_at_ms if deliver_at_ms is not None else now + max(delay_ms, 0)  # rows.due_at
    properties = pika.BasicProperties(
        delivery_mode=2, message_id=message_id, timestamp=now // 1000,
        headers=rows.message_headers(headers, due), content_type=content_type)
    return routing_key, bytes(body), properties
