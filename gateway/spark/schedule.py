"""`delay-gateway schedule INPUT`: the verb, for now in schedule_job.py (split next)."""

from gateway.spark.schedule_job import add_arguments, run

__all__ = ["add_arguments", "run"]
