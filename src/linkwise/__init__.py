"""linkwise: point-to-point and collective communication between processes, CPU and GPU,
over shared memory and TCP, that knows the machine's links.

    import linkwise
    comm = linkwise.init()          # under linkwise launch, torchrun, mpirun, srun, or alone
    comm.send(x, dst=1); comm.recv(y, src=0)
"""
from .comm import Communicator, Request
from ._world import init
from ._request import wait_all
from .topo.affinity import bind
from .errors import BootstrapError, CommAbortedError, LinkwiseError, PeerError, TimeoutError

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "init",
    "bind",
    "Communicator",
    "Request",
    "wait_all",
    "LinkwiseError",
    "PeerError",
    "TimeoutError",
    "BootstrapError",
    "CommAbortedError",
]
