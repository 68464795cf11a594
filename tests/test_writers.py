"""Who wrote a record in the streams, and what a reader keeps of it (pure: gateway/core/writers.py)."""

from gateway.core import cancels, rules, writers
from gateway.core.cancels import Time
from gateway.core.selection import Selection
from gateway.core.wire import long

GATEWAY = "delay-gateway"


def test_a_record_is_signed_with_the_user_and_read_back_by_whom_it_names():
    record = cancels.record(b"order-1", Time(5, None))
    signed = writers.signed(record, GATEWAY)
    assert signed.get("user_id") == b"delay-gateway" and signed.headers == record.headers
    assert writers.writer(signed, GATEWAY) is writers.Writer.GATEWAY
    assert writers.writer(signed, "someone") is writers.Writer.OTHER
    assert writers.writer(record, GATEWAY) is writers.Writer.UNSIGNED


def test_a_reader_of_the_cancellations_keeps_what_the_gateway_would():
    """Signed by the gateway user: everything. Unsigned (0.1.0 wrote cancels and marks so):
    cancels by id and marks, never a rule, tally or reservation. Another user's: nothing but the
    offset."""
    offset = long("x-stream-offset", 7)
    cancel = cancels.record(b"order-1", Time(5, 4))
    cancel = cancel.replace(headers=cancel.headers.with_entry(offset))
    props, body = rules.record(rules.Rule(b"r", Selection(key="a.#"), Time(5, None), False))
    rule = props.replace(headers=props.headers.with_entry(offset))
    mark = cancels.mark(b"token")
    tally = rules.tally_record(b"r", b"g" * 16, 3)
    reservation = cancels.reservation(123)
    for who, kept in ((GATEWAY, "all"), (None, "unsigned"), ("intruder", "offset")):
        def as_read(p, who=who):
            return writers.cancellation_headers(p if who is None else writers.signed(p, who), GATEWAY)
        assert (cancels.read_record(as_read(cancel)) is not None) == (kept != "offset")
        assert (rules.read_record(as_read(rule), body) is not None) == (kept == "all")
        assert (cancels.read_mark(as_read(mark)) == b"token") == (kept != "offset")
        assert (rules.read_tally(as_read(tally)) is not None) == (kept == "all")
        assert (cancels.read_reservation(as_read(reservation)) == 123) == (kept == "all")
        assert as_read(rule).get("x-stream-offset") == 7


def test_doubts_say_what_was_left_out_and_what_was_used_unsigned():
    doubts = writers.Doubts()
    assert not doubts
    for found in (writers.Writer.GATEWAY, writers.Writer.OTHER, writers.Writer.UNSIGNED, writers.Writer.OTHER):
        doubts.count(found)
    assert doubts and (doubts.other, doubts.unsigned) == (2, 1)
    assert doubts.why("the index") == (f"{writers.UNTRUSTED} in the index: 1 unsigned record(s) read, 2 record(s) of "
                                       "another user ignored")
