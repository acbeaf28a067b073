"""Who am I, how many are we, and where is rank 0: read from the launcher's environment.

:func:`detect` turns the environment of one of the supported launchers (``linkwise launch``,
torchrun, Open MPI, MPICH/Hydra, Slurm ``srun``) or explicit arguments into a
:class:`LaunchEnv`. The rendezvous :class:`~linkwise.store.Store` that rank 0 hosts at
``master_addr:master_port`` is re-exported here.

Contract: :func:`detect` is a function of its arguments and ``os.environ`` (no sockets; the
only I/O is reading /proc for the MPI daemon of a local mpirun that gives no job id); it
raises ``ValueError`` for values that are wrong (rank >= size, negative numbers,
non-integers) and :class:`~linkwise.errors.BootstrapError` when the environment does not say
enough to find rank 0 (then it says which variable to set).

Precedence, field by field:
  * rank/size/local_rank/local_size: explicit arguments, else the first launcher found in the
    order linkwise, torchrun, Open MPI, MPICH/Hydra, Slurm; else a single process (0 of 1).
    PMI variables without Hydra's MPI_LOCALRANKID inside a Slurm step are srun's own PMI
    (``srun --mpi=pmi2``), read as Slurm.
  * master address: explicit ``addr``, ``LINKWISE_MASTER_ADDR``, ``MASTER_ADDR``, the first host
    of Slurm's node list, else 127.0.0.1 when every rank is on this host, else an error.
  * master port: the port in explicit ``addr``, ``LINKWISE_MASTER_PORT``, ``MASTER_PORT + 1``
    (torchrun's agent, or torch's own TCPStore, already listens on ``MASTER_PORT`` itself, so
    linkwise takes the next port), else a port in [20000, 40000) derived from the launcher's
    job id (the same on every rank of a job), else 0 for a single process, else an error.
    A derived port (MASTER_PORT + 1 or from the job id) is a first choice: if something holds
    it, rank 0's store takes one of the next SPARE_PORTS ports and the others find it there
    (``LINKWISE_MASTER_PORT_SPARE`` sets that number for any port, given or derived).
  * job id: ``LINKWISE_JOB_ID``, else the launcher's job id, else "" (rank 0 makes one up).
"""
from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Optional

from . import config
from .errors import BootstrapError
from .store import Store, StoreClosedError  # noqa: F401  (re-exported)

__all__ = ["LaunchEnv", "detect", "expand_hostlist", "parse_tasks_per_node", "derive_port",
           "Store", "StoreClosedError"]

PORT_RANGE = (20000, 40000)
SPARE_PORTS = 8  # a derived port may move up by this many when taken (see store.py)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class LaunchEnv:
    """Where this process stands in the job. ``launcher`` is one of "explicit", "linkwise",
    "torchrun", "openmpi", "mpich", "slurm", "none"."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    launcher: str
    job_id: str
    #: How many ports above master_port the store may move to when that one is taken:
    #: SPARE_PORTS for a derived port (MASTER_PORT + 1, or from the job id), 0 for a given one,
    #: unless LINKWISE_MASTER_PORT_SPARE says otherwise.
    spare_ports: int = 0
    #: Where master_port came from, for error hints: "addr", "LINKWISE_MASTER_PORT",
    #: "MASTER_PORT" (its port + 1), "derived" (from the job id or the launcher), or "none"
    #: (a single process: port 0, any free one).
    port_source: str = field(default="derived", compare=False)


@dataclass
class _Found:
    """What one launcher's variables say; None where it says nothing."""
    launcher: str
    rank: int
    size: int
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    addr: Optional[str] = None
    port: Optional[int] = None
    port_seed: str = ""      # job-wide string a port can be derived from
    job_id: str = ""


# ---------------------------------------------------------------------------------- parsing
def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _first_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        v = _int(env, n)
        if v is not None:
            return v
    return None


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm host list {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if not rng:
            continue
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {rng!r} in Slurm host list item {item!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"descending range {rng!r} in Slurm host list item {item!r}")
        width = len(lo)
        for i in range(a, b + 1):
            for rest in _expand_one(tail):
                out.append(f"{head}{i:0{width}d}{rest}")
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm host-list syntax: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07
    gpu5. Zero padding follows the lower bound; several bracket groups multiply
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). Raises ValueError on malformed input."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` syntax: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"bad Slurm tasks-per-node value {text!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def derive_port(seed: str) -> int:
    """A port in [20000, 40000) that every rank computes alike from a job-wide string."""
    lo, hi = PORT_RANGE
    return lo + zlib.crc32(seed.encode()) % (hi - lo)


def _clean_id(text: str) -> str:
    """Job ids end up in shared-memory file names: keep [A-Za-z0-9_.-] only."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text.strip())


def _split_addr(addr: str) -> tuple[str, Optional[int]]:
    """'host', 'host:port', '[v6]:port' -> (host, port or None)."""
    addr = addr.strip()
    if not addr:
        raise ValueError("addr must be 'host' or 'host:port', got an empty string")
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif addr.count(":") == 1:
        host, _, port = addr.partition(":")
    else:
        host, port = addr, ""
    if not port:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"addr={addr!r}: port must be an integer in 1..65535")
    return host, int(port)


# -------------------------------------------------------------------------------- launchers
def _other_readings(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(launcher, "rank/size") of every launcher other than linkwise's whose variables are
    set ("?" where they do not parse)."""
    said = []
    for reader in _LAUNCHERS[1:]:
        try:
            found = reader(env)
        except ValueError:
            said.append((reader.__name__[1:], "?"))
            continue
        if found is not None:
            said.append((found.launcher, f"{found.rank}/{found.size}"))
    return said


def other_launchers(env: Mapping[str, str]) -> str:
    """What the launchers other than linkwise's say of this process ("torchrun 1/2, slurm
    0/4"), for LINKWISE_LAUNCH_OTHERS: `linkwise launch` records it in its ranks' environment."""
    return ", ".join(f"{name} {rank_size}" for name, rank_size in _other_readings(env))


def _refuse_inner_launcher(env: Mapping[str, str], rank: int, size: int) -> None:
    """A process with a `linkwise launch` rank's variables, where another launcher's say
    something else than when that rank was started (LINKWISE_LAUNCH_OTHERS): torchrun, mpirun
    or srun started from inside the rank, whose LINKWISE_* variables came along and would win,
    each process of the inner job taking the outer rank's place without an error. A reading
    the rank was started with is fine, and so is torchrun's RANK / WORLD_SIZE equal to the
    rank's own where torchrun's own TORCHELASTIC_RUN_ID is not there (a script that sets them
    for torch). The inner process whose rank and size equal the outer rank's is refused too:
    it would join the outer job as that rank (where the outer rank has not joined)."""
    recorded = env.get("LINKWISE_LAUNCH_OTHERS")
    if recorded is None:
        return
    known = set(recorded.split(", "))
    for name, rank_size in _other_readings(env):
        if f"{name} {rank_size}" in known:
            continue
        if rank_size == f"{rank}/{size}" and _set_for_torch(name, env, known):
            continue
        raise ValueError(
            f"this process has the LINKWISE_RANK / LINKWISE_SIZE of a rank of an outer `linkwise "
            f"launch` (rank {rank} of {size}) and was started by another launcher since "
            f"({name} {rank_size}); unset the outer job's variables for the inner one: env -u "
            f"LINKWISE_RANK -u LINKWISE_SIZE -u LINKWISE_LOCAL_RANK -u LINKWISE_LOCAL_SIZE -u "
            f"LINKWISE_MASTER_ADDR -u LINKWISE_MASTER_PORT -u LINKWISE_JOB_ID -u "
            f"LINKWISE_LAUNCH_OTHERS <launcher> ...")


def _set_for_torch(name: str, env: Mapping[str, str], known: set) -> bool:
    """Whether a reading equal to the rank's own is RANK / WORLD_SIZE that the rank's script
    set for torch: torchrun's, without the TORCHELASTIC_RUN_ID that torchrun itself sets (one
    an outer torchrun left, whose reading was recorded, says nothing)."""
    return name == "torchrun" and not ("TORCHELASTIC_RUN_ID" in env
                                       and not any(k.startswith("torchrun ") for k in known))


def _linkwise(env: Mapping[str, str]) -> Optional[_Found]:
    if "LINKWISE_RANK" not in env:
        return None
    rank, size = _int(env, "LINKWISE_RANK"), _int(env, "LINKWISE_SIZE")
    if size is None:
        raise ValueError("LINKWISE_RANK is set but LINKWISE_SIZE is not; set both")
    return _Found("linkwise", rank, size, _int(env, "LINKWISE_LOCAL_RANK"),
                  _int(env, "LINKWISE_LOCAL_SIZE"), env.get("LINKWISE_MASTER_ADDR"),
                  _int(env, "LINKWISE_MASTER_PORT"), job_id=env.get("LINKWISE_JOB_ID", ""))


def _torchrun(env: Mapping[str, str]) -> Optional[_Found]:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return _Found("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                  _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"),
                  env.get("MASTER_ADDR"), None, job_id="" if run_id == "none" else run_id)


def _openmpi(env: Mapping[str, str]) -> Optional[_Found]:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or ""
    return _Found("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                  _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  port_seed=job and "ompi:" + job, job_id=job)


def _mpich(env: Mapping[str, str]) -> Optional[_Found]:
    if "PMI_RANK" not in env or "PMI_SIZE" not in env:
        return None
    if "MPI_LOCALRANKID" not in env and "SLURM_PROCID" in env and \
            ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        # srun's own PMI (--mpi=pmi2) sets PMI_RANK / PMI_SIZE too, but nothing local; Hydra
        # always sets MPI_LOCALRANKID. The Slurm variables say where rank 0 is.
        return None
    # PMI_PORT (the Hydra PMI server's host:port) and PMIX_NAMESPACE are the same on every rank
    # of one mpiexec; PMI_ID is not used since older process managers set it per rank.
    seed = env.get("PMIX_NAMESPACE") or env.get("PMI_PORT") or ""
    return _Found("mpich", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                  _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"),
                  port_seed=seed and "pmi:" + seed, job_id=env.get("PMIX_NAMESPACE", ""))


def _slurm(env: Mapping[str, str]) -> Optional[_Found]:
    if "SLURM_PROCID" not in env or ("SLURM_NTASKS" not in env and "SLURM_NPROCS" not in env):
        return None
    size = _first_int(env, "SLURM_NTASKS", "SLURM_NPROCS")
    local_size = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            per_node = parse_tasks_per_node(env[name])
            node = _int(env, "SLURM_NODEID") or 0
            local_size = per_node[node] if node < len(per_node) else per_node[0]
            break
    if local_size is None and _int(env, "SLURM_NNODES") == 1:
        local_size = size
    addr = None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if nodelist:
        try:
            hosts = expand_hostlist(nodelist)
            addr = hosts[0] if hosts else None
        except ValueError:
            addr = None  # not parsable: fall back to MASTER_ADDR rules
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    job_id = f"{job}.{step}" if job and step else job
    return _Found("slurm", _int(env, "SLURM_PROCID"), size, _int(env, "SLURM_LOCALID"),
                  local_size, addr, None, port_seed=job_id and "slurm:" + job_id, job_id=job_id)


_LAUNCHERS = (_linkwise, _torchrun, _openmpi, _mpich, _slurm)

# Process names (/proc/<pid>/comm, at most 15 characters) of the daemons that start MPI ranks
# on a host: MPICH's and Intel MPI's Hydra proxies, Open MPI's mpirun / orted / PRRTE.
_MPI_DAEMONS = frozenset({"hydra_pmi_proxy", "pmi_proxy", "mpiexec.hydra", "mpiexec", "mpirun",
                          "orted", "prted", "prterun"})


def _mpi_daemon_pid(proc: str = "/proc", max_depth: int = 16) -> int:
    """The nearest ancestor that is an MPI daemon (_MPI_DAEMONS), else the parent: the ranks
    of one local mpirun / mpiexec agree on it even when a wrapper script (a shell that does
    not exec) runs between it and each rank. Reads /proc; the parent where it cannot."""
    parent = os.getppid()
    pid = parent
    for _ in range(max_depth):
        try:
            with open(f"{proc}/{pid}/comm") as f:
                if f.read().strip() in _MPI_DAEMONS:
                    return pid
            with open(f"{proc}/{pid}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and ')', so split after the last ')'.
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return parent


def _find_launcher(env: Mapping[str, str]) -> Optional[_Found]:
    for reader in _LAUNCHERS:
        found = reader(env)
        if found is not None:
            if found.rank is None or found.size is None:
                raise ValueError(f"{found.launcher} environment has no rank or no size")
            return found
    return None


# ----------------------------------------------------------------------------------- detect
def _validate(e: LaunchEnv) -> LaunchEnv:
    where = f"(launcher {e.launcher})"
    if e.size < 1:
        raise ValueError(f"size must be >= 1, got {e.size} {where}")
    if not 0 <= e.rank < e.size:
        raise ValueError(f"rank must be in 0..{e.size - 1} for size {e.size}, got {e.rank} {where}")
    if e.local_size < 1 or e.local_size > e.size:
        raise ValueError(f"local_size must be in 1..{e.size}, got {e.local_size} {where}")
    if not 0 <= e.local_rank < e.local_size:
        raise ValueError(f"local_rank must be in 0..{e.local_size - 1}, got {e.local_rank} {where}")
    if not 0 <= e.master_port < 65536:
        raise ValueError(f"master port must be in 0..65535, got {e.master_port} {where}")
    if not 0 <= e.spare_ports <= 1024:
        raise ValueError(f"LINKWISE_MASTER_PORT_SPARE must be in 0..1024, got {e.spare_ports}")
    return e


def detect(rank: Optional[int] = None, size: Optional[int] = None,
           addr: Optional[str] = None) -> LaunchEnv:
    """Work out this process's :class:`LaunchEnv` (see the module docstring for precedence).

    ``addr`` is ``"host"`` or ``"host:port"`` of the rendezvous store (rank 0). With explicit
    ``rank``/``size`` and no launcher, ranks are taken to share this host when ``addr`` is
    absent or loopback; otherwise local_rank/local_size are unknown and reported as 0/1
    (transports find co-located peers through the store)."""
    env = os.environ
    found = _find_launcher(env)
    explicit_host, explicit_port = _split_addr(addr) if addr is not None else (None, None)

    if rank is not None or size is not None:
        if rank is None or size is None:
            if found is None:
                raise ValueError("pass both rank= and size= (no launcher variables were found)")
            rank = found.rank if rank is None else rank
            size = found.size if size is None else size
        launcher = "explicit"
        if found is not None and found.rank == rank and found.size == size \
                and found.local_rank is not None and found.local_size is not None:
            local_rank, local_size = found.local_rank, found.local_size
        elif explicit_host is None or explicit_host in _LOOPBACK:
            local_rank, local_size = rank, size
        else:
            local_rank, local_size = 0, 1
    elif found is not None:
        if found.launcher == "linkwise":
            _refuse_inner_launcher(env, found.rank, found.size)
        launcher, rank, size = found.launcher, found.rank, found.size
        local_rank, local_size = found.local_rank, found.local_size
        if local_size is None:
            # The launcher does not say how many ranks share this host: report a lower bound
            # and do not assume a single-host job (the master address must then be given).
            local_rank = local_rank if local_rank is not None else 0
            local_size = local_rank + 1
        elif local_rank is None:
            raise ValueError(f"{launcher} gives the local size but no local rank")
    else:
        launcher, rank, size, local_rank, local_size = "none", 0, 1, 0, 1
    if not isinstance(rank, int) or not isinstance(size, int):
        raise TypeError(f"rank and size must be integers, got {rank!r} and {size!r}")

    all_local = size == 1 or local_size == size
    host = (explicit_host or config.get("LINKWISE_MASTER_ADDR") or env.get("MASTER_ADDR")
            or (found.addr if found else None))
    if not host:
        if not all_local:
            raise BootstrapError(
                f"cannot tell where rank 0 is: {launcher} gives no master address and the "
                f"{size} ranks are on several hosts; set LINKWISE_MASTER_ADDR to rank 0's host "
                f"(and LINKWISE_MASTER_PORT to a free port)")
        host = "127.0.0.1"

    torch_port = _int(env, "MASTER_PORT")
    port = explicit_port if explicit_port is not None else config.get("LINKWISE_MASTER_PORT")
    source = "addr" if explicit_port is not None else "LINKWISE_MASTER_PORT"
    derived = port is None and size > 1
    if port is None and torch_port is not None:
        port, source = (torch_port + 1 if torch_port < 65535 else 65534), "MASTER_PORT"
    if port is None and found is not None and found.port_seed:
        port, source = derive_port(found.port_seed), "derived"
    if port is None and found is not None and found.launcher in ("openmpi", "mpich") and all_local:
        # All ranks of a local mpirun/mpiexec descend from one MPI daemon; a wrapper script
        # between it and the rank (mpiexec -n 2 ./wrap.sh train.py) is skipped.
        port, source = derive_port(f"{found.launcher}:ppid:{_mpi_daemon_pid()}"), "derived"
    if port is None:
        if size > 1:
            raise BootstrapError(
                f"cannot choose the rendezvous port: {launcher} gives no job id; set "
                f"LINKWISE_MASTER_PORT (the same free port on every rank) or pass addr='host:port'")
        port, source = 0, "none"  # a single process: no store to find

    job_id = config.get("LINKWISE_JOB_ID") or (found.job_id if found else "") or ""
    spare = config.get("LINKWISE_MASTER_PORT_SPARE")
    if spare is None:
        spare = SPARE_PORTS if derived else 0
    return _validate(LaunchEnv(rank, size, local_rank, local_size, host, int(port), launcher,
                               _clean_id(job_id), int(spare), source))
