"""The SparkSession of a command: the one spark-submit made, or a local one.

Under spark-submit (or with a master in spark-defaults.conf) the master and every setting
come from there; run as `delay-gateway schedule ...` the default is `local[*]`, all cores
of this machine. `--master` beats both. A session that already exists in the process (a
notebook, the tests) is used as it is, and is not stopped at the end.
"""

import logging
import os
import sys
import tempfile
from typing import Any, Dict, Iterable, Optional, Tuple


def start(app: str, master: Optional[str] = None, confs: Iterable[Tuple[str, str]] = ()):
    """(spark, owned): owned is False when the session was there already."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        return SparkSession.builder.getOrCreate(), False
    # The executors' Python must be one with pika and this package: the driver's, unless
    # the user chose (a cluster's nodes have their own paths).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # reads spark-submit's settings and spark-defaults.conf; starts the JVM unless spark-submit did
    launch, profile = _quiet_jvm(dict(confs))
    SparkContext._ensure_initialized(conf=launch)
    given = SparkConf()
    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master)
    elif not given.contains("spark.master"):
        builder = builder.master("local[*]")
    if "spark.ui.showConsoleProgress" not in dict(confs):
        # Spark's own progress bar ([Stage 2:====>   (3 + 2) / 8]) on a terminal, as in its
        # shells; not into a log file or a pipe
        builder = builder.config("spark.ui.showConsoleProgress", str(sys.stderr.isatty()).lower())
    for key, value in confs:
        builder = builder.config(key, value)
    # py4j logs every connection it closes at info level: noise among our own events
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR" if profile else "WARN")
    if profile:
        os.unlink(profile)  # read when the JVM started
    return spark, True


# Spark's default log4j profile writes its start-up warnings (host name, native libraries,
# "Setting default log level") among the command's own output. This one keeps errors, on stderr.
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
# errors only, by the appender: a root level other than WARN makes Spark announce that it
# changes it ("Setting default log level to WARN"), on stderr, at every start
appender.console.filter.threshold.type = ThresholdFilter
appender.console.filter.threshold.level = error
"""


def _quiet_jvm(confs: Dict[str, str]) -> Tuple[Any, Optional[str]]:
    """The settings the JVM starts with, and the file of our log4j profile, unless the user
    has their own (driver Java options, or a log4j2.properties in SPARK_CONF_DIR)."""
    from pyspark import SparkConf

    conf = SparkConf(loadDefaults=False)
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if "spark.driver.extraJavaOptions" in confs or (conf_dir and os.path.exists(
            os.path.join(conf_dir, "log4j2.properties"))):
        return conf, None
    fd, path = tempfile.mkstemp(prefix="delay-gateway-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(LOG4J2)
    return conf.set("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{path}"), path


def conf_pairs(pairs: Iterable[str]) -> Tuple[Tuple[str, str], ...]:
    from gateway.settings import UsageError
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--spark-conf {pair!r}: expected KEY=VALUE")
        out.append((key.strip(), value))
    return tuple(out)


def said_spark_failed(command: str, error: BaseException) -> bool:
    """Spark's own failure (not ours) is one line on stderr, not a Java stack trace: True
    when it was said, and the command exits 1."""
    if not type(error).__module__.startswith(("pyspark", "py4j")):
        return False
    print(f"delay-gateway {command}: Spark failed: {one_line(error)}", file=sys.stderr)
    return True


def one_line(error: BaseException) -> str:
    """The useful line of a Spark error (a Py4J error carries a Java stack trace, and a
    failed Python task the worker's traceback: the last 'SomethingError: ...' line of it)."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("PublishError", "Rejected")):
            return line.split(":", 1)[1].strip()
    for line in lines:
        if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]:
            return line[:500]
    return (lines[0] if lines else repr(error))[:500]
