"""The parts of the topology that talk to a broker: declaring a chain and reading what a
broker holds (the registry, queue depths). Everything else in topology/ is pure."""
