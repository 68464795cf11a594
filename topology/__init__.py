"""The gateway's topology: what to declare (pure) and adapters that declare or render it."""

from topology.encoding import Enter, Meditate, ToDistributor, bit_key, key_units, plan, units_for
from topology.model import Binding, Exchange, Queue, Topology, build
from topology.names import Names
from topology.settings import ChainSettings

__all__ = [
    "Binding", "ChainSettings", "Enter", "Exchange", "Meditate", "Names", "Queue",
    "ToDistributor", "Topology", "bit_key", "build", "key_units", "plan", "units_for",
]
