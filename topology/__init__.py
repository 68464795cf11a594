"""The gateway's topology: what to declare (pure) and adapters that declare or render it."""

from .encoding import Enter, Meditate, ToDistributor, bit_key, key_units, plan, units_for
from .model import Binding, Exchange, Queue, Topology, build
from .names import Names
from .settings import ChainSettings

__all__ = [
    "Binding", "ChainSettings", "Enter", "Exchange", "Meditate", "Names", "Queue",
    "ToDistributor", "Topology", "bit_key", "build", "key_units", "plan", "units_for",
]
