"""The pika adapters: connections, the consumer shell around the core, publishing, the worker
process and its housekeeping thread. They turn frames into core events and core actions into
frames, and decide nothing about a message themselves."""
