"""Connection plumbing every part of the broker side stands on: connecting and sorting what
goes wrong (amqp), the fast connection (wire_connection), content properties kept as their
exact bytes (lazy_properties) and basic.publish written as frames (publish_frames). It
imports nothing from run/ or tools/."""
