"""The named scenarios `python -m bench` runs, and the groups that name several at once.

Each scenario takes the run's `Context` and returns a list of JSON-able dicts, one per run.
"""

from .baselines import floor, hops, naive
from .catch_up import catch_up
from .ceilings import ceiling, steady
from .footprint import footprint
from .memory import holding, pending
from .move import move
from .quiet import idle, trickle
from .roles import roles
from .side_by_side import at_once, burst, paced
from .at_scale import waiting
from .soak import soak
from .vhosts import vhosts

SCENARIOS = {"paced": paced, "burst": burst, "at-once": at_once, "pending": pending, "steady": steady,
             "roles": roles, "ceiling": ceiling, "hops": hops, "idle": idle, "trickle": trickle, "naive": naive,
             "floor": floor, "waiting": waiting, "holding": holding,
             "footprint": footprint, "vhosts": vhosts, "soak": soak, "catch-up": catch_up,
             "move": move}
# Names for several at once.
GROUPS = {"issue": ["paced", "burst", "at-once", "floor", "ceiling", "idle", "trickle"],
          "all": [s for s in SCENARIOS if s not in ("pending", "waiting", "holding", "footprint", "vhosts", "soak",
                                                    "catch-up", "move")]}
