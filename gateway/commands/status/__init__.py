"""`delay-gateway status`: what waits where, and when it falls due; one module per idea.

- report: the pure model: queue counts and settings in, a table of what waits out;
- render: that table as text or JSON;
- metrics: what the gateways' /metrics pages add (held, carried, retried messages);
- reads: what is read from the broker (AMQP) and the gateways (HTTP) for one report;
- watch: the verb: its arguments, and the report printed once or every --interval.

The report never reads a message: a message's place in the chain bounds its due time, so
counts alone answer "when", at any number of messages. A message in level k's delay queue
waits at most 2^k units there and at most 2^k - 1 more in the levels below, then at most
one unit plus the lead in the distributor: it is due within 2^(k+1) units plus the lead.
One in a pass-through queue is due within 2^k units plus the lead; one in meditation
needed more than the chain's maximum when it entered, and is due at least one unit from now.

What AMQP cannot show is said so: the distributor's held messages (delivered to it and not
yet acknowledged) are not in any count a passive declare returns; `--metrics-url` reads
them from the gateways' /metrics.
"""
