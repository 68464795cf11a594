"""One logging setup for the gateway and pika: JSON off a TTY, readable on one."""

import logging
import sys

import structlog


def configure(level: str = "info", fmt: str = "auto") -> None:
    json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
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
    # pika narrates every frame at INFO; its warnings and errors are what an operator needs.
    logging.getLogger("pika").setLevel(max(logging.WARNING, root.level))
    # ...but a channel the broker closes is reported by the gateway itself, with the fix.
    logging.getLogger("pika.channel").setLevel(max(logging.ERROR, root.level))
