"""The benchmark: `python -m bench SCENARIO...` from a checkout (not shipped with the gateway).

It measures the gateway as its users would: the real `delay-gateway run` process
(tests/launcher.py, borrowed from the tests), a publisher with confirms that says when each
message is due with `x-delay` (or `x-deliver-at`), and a separate receiver process bound
where delayed messages come out. Lateness is arrival time minus (publish time + delay), on
the publisher's clock. It sees the gateway only through its public contract, /readyz and
/metrics, and the broker through its own counters; with --compare-plugin the same loads run
through the rabbitmq-delayed-message-exchange plugin, alternating.
"""
