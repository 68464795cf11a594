"""Exit codes of every command (README): 0 done, 2 a bad flag, value or setting
(UsageError), and for the broker's troubles: those that might heal (none answered) and
those that will not (refused: a retry cannot help)."""

EXIT_NO_BROKER, EXIT_REFUSED = 1, 3


class UsageError(ValueError):
    """A bad flag or environment value: one line, exit 2."""
