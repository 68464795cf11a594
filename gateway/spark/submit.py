"""The application file for spark-submit, which runs Python applications from a .py file:

    spark-submit --master spark://HOST:7077 "$(python -m gateway.spark.submit)" schedule INPUT ...

Run as `python -m gateway.spark.submit` it prints its own path; run by spark-submit it is
`delay-gateway` with the arguments that follow, in the session spark-submit configured.
"""

import os
import sys


def main() -> int:
    if os.environ.get("PYSPARK_GATEWAY_PORT") is None and sys.argv[1:] in ([], ["--path"]):
        print(os.path.abspath(__file__))
        return 0
    from gateway.cli import main as cli
    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
