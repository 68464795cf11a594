"""The `run` process: the worker (preparing, the reconnect loop), its sessions and consumers,
the virtual hosts it serves, its upkeep thread, when it connects again, and the two streams it
keeps beside the messages: the cancellations it follows and the index of what waits it writes
(with the readers the verbs use to read them back)."""
