"""Which way a publish takes a message: the routing vocabulary the core's modules share (pure)."""

from enum import Enum
from typing import Optional, Tuple


class Way(str, Enum):
    """Which way a publish takes a message: what the core decides on, and (its value) the
    `outcome` label of the metrics."""

    CHAIN = "chain"  # into a level of the chain
    MEDITATION = "meditation"  # round the meditation queue (longer than the chain)
    DISTRIBUTOR = "distributor"  # to the distributor, which holds it until due
    DELIVERED = "delivered"  # to pick-up
    RETRIED = "retried"  # a retry, back to its queue
    PARKED = "parked"  # set aside with its reason
    RECHECK = "recheck"  # reached the distributor far too early: back into the chain
    HANDED_BACK = "handed back"  # held when the gateway stopped: back to the distributor queue
    CANCEL = "cancel"  # a cancel's record, into the cancellations stream
    INDEX = "index"  # a record of what waits, into a waiting stream (index_records.py)


# Sent on to wait (an entry in the index). A recheck (the distributor had it far too early)
# waits until the same due time as the entry that sent it there says: no new entry.
STAYS = (Way.CHAIN, Way.MEDITATION, Way.DISTRIBUTOR)
LEAVES = (Way.DELIVERED, Way.RETRIED, Way.PARKED)  # sent on to leave the gateway

# A carrier batch's route (carrier.Batcher): exchange, routing key, way, the messages' own
# destination, and for what the distributor will hold, the second they are due in
# (flow.HOLD_BUCKET_MS): a carrier is acknowledged once its last message is released, and one
# the distributor held when it died comes back whole, so its messages are due close together.
Route = Tuple[str, bytes, Way, Optional[str], int]
