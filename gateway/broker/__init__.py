"""The pika adapters, in three rooms by what each part serves: plumbing/ (connecting, sorting
errors, frames and properties as exact bytes), run/ (the `run` process: its consumers,
reconnects, upkeep, cancellations and the index's streams) and tools/ (what the other verbs
use to publish and to read the plugin's table). They turn frames into core events and core
actions into frames, and decide nothing about a message themselves."""
