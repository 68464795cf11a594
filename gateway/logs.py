"""One logging setup for the gateway and pika: JSON off a TTY, readable on one."""

import logging
import sys
from typing import List

import structlog
from structlog.typing import Processor


def configure(level: str = "info", fmt: str = "auto") -> None:
    json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared: List[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Colour codes only where a terminal reads them, not in a file or a pipe.
    renderer = structlog.processors.JSONRenderer() if json else \
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=shared + [structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # pika narrates every frame at INFO, and a refused connection as five errors with a
    # traceback; the gateway reports each trouble itself, once, with the fix (broker.plumbing.amqp).
    # --log-level debug shows pika's warnings and errors as well.
    debug = root.level <= logging.DEBUG
    logging.getLogger("pika").setLevel(logging.WARNING if debug else logging.CRITICAL + 1)


def last_line(text: str) -> None:
    """A command's closing line on stderr, written whole: a log line from another thread
    (upkeep, cancellations) never lands inside it, as it could between print's text and its
    newline."""
    handlers = logging.getLogger().handlers
    for h in handlers:
        h.acquire()
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    finally:
        for h in reversed(handlers):
            h.release()
