import pytest


@pytest.fixture(scope="session")
def spark():
    """One real local Spark for every Spark test (starting one costs 10-20 s). The commands
    run in-process use it as they would a notebook's session."""
    from gateway.spark import session
    s, owned = session.start("delay-gateway tests", "local[2]", (
        ("spark.sql.shuffle.partitions", "4"),  # small data: 200 shuffle tasks would dominate
        ("spark.ui.enabled", "false"),
        ("spark.ui.showConsoleProgress", "false")))
    yield s
    if owned:
        s.stop()
