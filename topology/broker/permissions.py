"""Which permission an operation on the broker needs, so that a refusal can name it.

RabbitMQ 4 says in a refusal which permission was missing ("read access to queue ...");
RabbitMQ 3.10 does not ("access to queue ..."). The operation knows: consuming or getting
needs read on the queue, publishing needs write on the exchange, declaring needs configure
(a passive declare too, on RabbitMQ 4). Code that does one wraps it in `needing`, and a
refusal (403) comes out as `Refused`, which says the permission.
"""

import contextlib
import re
from typing import Iterator, Optional

from pika.exceptions import ChannelClosedByBroker

PERMISSIONS = ("configure", "write", "read")
# RabbitMQ's words: "ACCESS_REFUSED - [read ]access to queue 'x' in vhost '/' refused for user 'u'"
_REFUSAL = re.compile(r"ACCESS_REFUSED - (?:(configure|write|read) )?access to (queue|exchange|topic) "
                      r"'(.*)' in vhost '(.*)' refused for user '(.*)'", re.DOTALL)


class Refused(ChannelClosedByBroker):
    """The broker refused an operation (403) that needs `permission`."""

    def __init__(self, reply_code: int, reply_text: str, permission: Optional[str]) -> None:
        super().__init__(reply_code, reply_text)
        self.permission = permission


def refusal(text: str) -> Optional[tuple]:
    """(permission or None, kind, name, vhost, user) of a refusal's text; None if it is not one."""
    found = _REFUSAL.match(text or "")
    return found.groups() if found else None


@contextlib.contextmanager
def needing(permission: str) -> Iterator[None]:
    """A 403 inside is re-raised as Refused(permission): the operation says which it needs."""
    assert permission in PERMISSIONS
    try:
        yield
    except Refused:
        raise
    except ChannelClosedByBroker as exc:
        if exc.reply_code != 403:
            raise
        raise Refused(exc.reply_code, exc.reply_text, permission) from None
