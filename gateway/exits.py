"""Exit codes of every command (README): 0 done, 2 a bad flag, value or setting
(UsageError), and for the broker's troubles: those that might heal (none answered) and
those that will not (refused: a retry cannot help)."""

EXIT_NO_BROKER, EXIT_REFUSED = 1, 3


class UsageError(ValueError):
    """A bad flag or environment value: one line, exit 2."""


class ExitCodeError(RuntimeError):
    """An error, already explained in one line, that knows the exit code it ends a command
    with (a broker's trouble: broker/plumbing/amqp.BrokerError)."""

    @property
    def exit_code(self) -> int:
        raise NotImplementedError
