"""The data side: Spark jobs that schedule a table of messages and analyse deliveries.

`schedule` publishes rows to `<prefix>.check-in` like any other publisher (it uses only the
public contract: the exchange name and the `x-deliver-at` header); `record` consumes from
a queue bound to `<prefix>.pick-up`; `report` reads what `record` wrote. PySpark is an
optional extra, imported only by the commands that need it (`require`).

Modules: rows (pure: one input row to a message or a rejection), publisher (pika, windowed
confirms, one connection per partition), progress (the resume record), schedule (the verb:
its arguments and its run) and its job: schedule_job (on the driver), columns (which column
is what, and every row checked), errors_output (the rejected rows and the counts), tally
(how far publishing got, said every few seconds), schedule_task (on the executors);
cancel (its counterpart, cancel-table), table_job (what schedule and cancel share), record
(the consumer), report (the Spark analysis and its charts), example (an orders table to try
it with), pending (what waits, read back as a DataFrame), session (the SparkSession),
submit (the application file for spark-submit).
"""

# The package is installed from a clone (it is on no package index): the same line in docs/spark.md.
INSTALL = "python -m pip install -e '.[spark]' in a clone of the repository (docs/spark.md)"


def require() -> None:
    """Fail in one line, naming the install command, when PySpark is missing."""
    from gateway.settings import UsageError
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise UsageError(f"this command runs on Spark and PySpark is not installed: {INSTALL}") from None
