"""The pure core: what a message is on the wire, what the gateway decides for each delivery,
and all per-delivery state. No I/O and no pika: everything here is tested without a broker."""
