"""`python -m bench`: scenarios that measure the gateway from the outside.

The real gateway runs as separate processes (`run --role check-in` and `--role
distributor`); a publisher (this process) and a receiver (a child process bound to pick-up)
time every message. Lateness is receive time minus the due time the publisher wrote in
`x-deliver-at` (and in the body). Nothing here is imported by the gateway itself.
"""
