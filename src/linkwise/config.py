"""The one registry of ``LINKWISE_*`` tunables.

Every environment variable linkwise reads is declared here once, with its type, default and a
line of help; code reads it through :func:`get`, and ``linkwise info`` prints the table. (Not
the launchers' variables bootstrap reads, nor LINKWISE_BENCH_ARGS / _SYSTEMS / _RESULT, which
`linkwise bench` sets for the ranks it starts.)
Values are read from the environment at each call (cheap), so tests may set them per process.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection


@dataclass(frozen=True)
class Tunable:
    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str

    def current(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r} is not valid: {exc}") from None


def _size(text: str) -> int:
    """Parse a byte size such as ``4096``, ``64K``, ``1M``, ``2GiB`` (not negative)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if t[-1:] in "KMG":
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise ValueError("expected a byte size such as 4096, 64K, 1M or 2GiB") from None
    if not 0 <= value < float(1 << 63):  # also NaN and infinity
        raise ValueError("expected a byte size of 0 or more, such as 4096, 64K, 1M or 2GiB")
    return int(value)


def _count(text: str) -> int:
    """A whole number of 0 or more."""
    value = int(text)
    if value < 0:
        raise ValueError("expected a whole number of 0 or more")
    return value


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 0/1, true/false, yes/no or on/off")


def _choice(*choices: str, empty: str = "") -> Callable[[str], str]:
    """Parse one of `choices` (case-insensitive). With `empty` (what an empty or unset variable
    means), a blank value is accepted too and parses as ""."""
    expected = f"expected one of {', '.join(choices)}"
    if empty:
        expected += f" (empty or unset: {empty})"

    def parse(text: str) -> str:
        t = text.strip().lower()
        if t in choices or (empty and not t):
            return t
        raise ValueError(expected)
    return parse


TUNABLES: dict[str, Tunable] = {}


def declare(name: str, default: Any, parse: Callable[[str], Any], help: str) -> Tunable:
    """Register a tunable; each name is declared exactly once, in this module."""
    if name in TUNABLES:
        raise RuntimeError(f"tunable {name} declared twice")
    TUNABLES[name] = Tunable(name, default, parse, help)
    return TUNABLES[name]


def get(name: str) -> Any:
    """Current value of a declared tunable (environment, else default)."""
    return TUNABLES[name].current()


# The tunables a communicator reads while it is made (init, split: links, shared-memory
# executor), as names or prefixes. Those read at each call (LINKWISE_ALGO, _CHUNK_SIZE, _CHECK)
# are checked there.
READ_WHEN_MADE = ("LINKWISE_TIMEOUT", "LINKWISE_TRANSPORT", "LINKWISE_SOCKET_IFNAME", "LINKWISE_SHM_",
                  "LINKWISE_SPIN_US", "LINKWISE_COPY_DETOUR", "LINKWISE_DEBUG", "LINKWISE_LOCAL_SIZE",
                  "LINKWISE_COLL_")
# Those the GPU plane reads when it is made (GpuComm); the CUDA code reads several of them
# itself with atoi, so "256K" would run as 256 while `linkwise info` calls it invalid.
READ_BY_GPU_PLANE = ("LINKWISE_GPU_", "LINKWISE_P2P_DISABLE", "LINKWISE_STAGED_", "LINKWISE_DEVICE")


def first_invalid(names: tuple = READ_WHEN_MADE, skip: Collection[str] = ()) -> str:
    """The error of the first tunable named by `names` (names or prefixes), other than those
    in `skip` (whole names), set to a value its parser refuses ("" if none). Making a
    communicator (or its GPU plane) carries it in this rank's card, so that every rank raises
    at once: a rank that raised on its own left the others waiting for it until the timeout.
    `linkwise bench` checks the variables its ranks will read with it before starting them."""
    for name, tunable in TUNABLES.items():
        if name.startswith(names) and name not in skip:
            try:
                tunable.current()
            except ValueError as exc:
                return str(exc)
    return ""


def seconds(raw: Any, op: str = "") -> float:
    """A timeout: a positive, finite number of seconds (NaN, inf, 0 and below are refused).
    op: the call it is for, named in the error as the native checks do ("recv: timeout 0: ...")."""
    where = f"{op}: " if op else ""
    try:
        t = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where}timeout {raw!r}: give seconds, a positive number") from None
    if not 0 < t < float("inf"):
        raise ValueError(f"{where}timeout {raw!r}: give seconds, a positive finite number")
    # Clamped to a quarter of the longest wait that sockets and threading accept (about 73
    # years, room left for the margins added to it): 1e10 made store requests raise OverflowError.
    return min(t, MAX_TIMEOUT)


MAX_TIMEOUT = threading.TIMEOUT_MAX / 4


declare("LINKWISE_TIMEOUT", 300.0, seconds, "seconds any blocking call waits before raising TimeoutError "
        "(a positive, finite number)")
declare("LINKWISE_TRANSPORT", "auto", _choice("auto", "shm", "tcp"),
        "auto: shared memory within a host, TCP across hosts; tcp forces TCP everywhere; shm "
        "insists on shared memory (every rank on this host, else BootstrapError)")
declare("LINKWISE_SOCKET_IFNAME", "", str,
        "interfaces for TCP, as NCCL_SOCKET_IFNAME: 'eth' prefix, '^docker,lo' exclude, '=eth0' exact")
declare("LINKWISE_SHM_RING_SIZE", 1 << 20, _size, "bytes of each shared-memory ring between two ranks")
declare("LINKWISE_SHM_RNDV_THRESHOLD", 64 << 10, _size,
        "messages at least this large go single-copy (process_vm_readv) instead of through the ring")
def _spin_us(text: str) -> float:
    """-1 (pick), or 0 to 1,000,000 microseconds: a wait checks the timeout and its peers only
    after spinning, so an endless spin (inf) would never notice either."""
    value = float(text)
    if value != -1 and not 0 <= value <= 1e6:  # also NaN and infinity
        raise ValueError("expected -1 (pick by cores) or microseconds from 0 to 1000000")
    return value


declare("LINKWISE_SPIN_US", -1.0, _spin_us,
        "microseconds a waiting rank spins before it sleeps (0 to 1000000); -1 picks by cores per local rank "
        "(50 with a core each, else 1); from 10 up, point-to-point waits adapt it (up to 2 ms)")
declare("LINKWISE_COPY_DETOUR", "auto", _choice("auto", "on", "off", "1", "0"),
        "copies whose destination lies 1-31 bytes past the source within a 4 KiB page avoid the "
        "CPU's string copy (slow there on AMD EPYC, docs/benchmarks.md); auto = on for AMD CPUs")
declare("LINKWISE_DEBUG", False, _bool, "log bootstrap and transport setup to stderr")
# Set by `linkwise launch` (or by hand); read by linkwise.bootstrap.detect.
declare("LINKWISE_RANK", None, int, "this process's rank (set by `linkwise launch`)")
declare("LINKWISE_SIZE", None, int, "number of ranks (set by `linkwise launch`)")
declare("LINKWISE_LOCAL_RANK", None, int, "rank among the processes of this host")
declare("LINKWISE_LOCAL_SIZE", None, int, "number of ranks on this host")
declare("LINKWISE_MASTER_ADDR", "", str, "host of rank 0's rendezvous store (overrides MASTER_ADDR)")
declare("LINKWISE_MASTER_PORT", None, int,
        "port of rank 0's rendezvous store; default MASTER_PORT+1, else derived from the job id "
        "(a derived port may move up to 8 higher when taken)")
declare("LINKWISE_MASTER_PORT_SPARE", None, int,
        "how many ports above the store's port rank 0 may move to when that one is taken (the "
        "others find it by a job token); default 8 for a derived port, 0 for a given one")
declare("LINKWISE_JOB_ID", "", str, "job identifier: in the rendezvous handshake (two jobs on one port stay "
        "apart) and the labels of the shared-memory segments (anonymous memfds, never in /dev/shm)")
declare("LINKWISE_LAUNCH_CPUS", "", str,
        "CPUs given to `linkwise launch` (comma list; set by it for ranks it binds): where a bound "
        "rank starts helper processes such as the benchmark's mpirun")
declare("LINKWISE_LAUNCH_OTHERS", None, str,
        "set by `linkwise launch`: what other launchers' variables said when it started the rank; "
        "init() refuses a process another launcher started inside the rank since (RANK / "
        "WORLD_SIZE equal to the rank's own, without torchrun's TORCHELASTIC_RUN_ID, are the "
        "script's and fine)")
declare("LINKWISE_LAUNCH_FD", None, int,
        "set by `linkwise launch`: the rank's socket to the launcher, through which init() learns "
        "that a rank ended without calling init() (it then raises instead of waiting)")
declare("LINKWISE_LAUNCH_PID", None, int,
        "set by `linkwise launch`: its pid; LINKWISE_LAUNCH_FD is used only where that is its peer")
declare("LINKWISE_LAUNCH_SET", None, str,
        "set by `linkwise launch`: JSON of the OMP_NUM_THREADS, LINKWISE_DEVICE, LINKWISE_SOCKET_IFNAME "
        "it set for the rank, so that a launch nested in the rank works out its own for those "
        "(values the user set are kept)")
declare("LINKWISE_DEVICE", None, int, "CUDA ordinal (after CUDA_VISIBLE_DEVICES) this rank uses (set by `linkwise launch --bind auto`)")
declare("LINKWISE_TOPO_FILE", "", str,
        "a topology JSON (linkwise topo --save) used instead of discovering this machine")
# Collectives (issue 3), read per call by linkwise.collectives.
declare("LINKWISE_ALGO", "", _choice("ring", "tree", "chain", "direct", empty="pick by size"),
        "force a collective algorithm (ring, tree, chain, direct); empty picks by size")
declare("LINKWISE_CHUNK_SIZE", 0, _size,
        "pipelining chunk of ring/chain collectives in bytes; 0 = default (512K); also the chunk of "
        "host-staged GPU collectives (0 = 4M there); every collective raises ValueError while it is "
        "not a byte size of 0 or more")
declare("LINKWISE_CHECK", False, _bool,
        "verify before each collective that all ranks agree on size/dtype/op/root and host vs CUDA arrays (raise ValueError on every rank if not)")
# Shared-memory collectives on one host (read when a communicator is made: init and split
# attach its executor).
declare("LINKWISE_SHM_CMA", True, _bool,
        "large single-host all_reduce/broadcast copy straight between the ranks' buffers "
        "(process_vm_readv/writev) when permitted; 0 forces the copy-through-shared-memory paths")
declare("LINKWISE_COLL_CMA_MIN", 0, _size,
        "all_reduce of at least this many bytes uses that single-copy path; 0 = 8M with several "
        "threads per rank (LINKWISE_COLL_THREADS), never with one (kernel copies lose to memcpy there)")
declare("LINKWISE_COLL_CMA_BCAST_MIN", 0, _size,
        "broadcast of at least this many bytes uses it; 0 = 4M with 2 ranks of one thread, else 8M up "
        "to 4 ranks, never with more")
declare("LINKWISE_COLL_CMA_CHUNK", 128 << 10, _size, "bytes a single-copy all_reduce reduces per step")
declare("LINKWISE_COLL_CMA_PIECE", 256 << 10, _size, "bytes per piece of a single-copy broadcast")
declare("LINKWISE_COLL_LANE_MIN", 256 << 10, _size,
        "with several threads per rank, a two-shot all_reduce or ring broadcast of at least 2x this "
        "many bytes runs as min(threads, bytes / this) lanes, one thread each")
declare("LINKWISE_COLL_ONE_SHOT_MAX", 0, _size,
        "all_reduce of at most this many bytes within a host runs one-shot (every rank reads every "
        "input), larger two-shot; 0 = 16K / ranks with a core per rank, 32K with 2 ranks or shared "
        "cores; at most 32K")
declare("LINKWISE_COLL_THREADS", 0, int,
        "threads per rank for single-copy collectives and lanes; 0 = 3/4 of the CPUs this rank "
        "counts as its own (the CPUs its host's ranks may use together / ranks, at most its own "
        "affinity), 2 with 2-2.7 of them, at least 1, at most 8 (set it to up to 16 for more lanes)")
# GPU data plane (linkwise.cuda), read when a communicator's GpuComm is built.
declare("LINKWISE_P2P_DISABLE", False, _bool,
        "never map peers' GPU memory: stage every GPU transfer through pinned host memory")
declare("LINKWISE_GPU_SLOT_BYTES", 16 << 20, _size, "bytes of each rank's GPU scratch slot")
declare("LINKWISE_GPU_ONESHOT_MAX", 0, _size, "largest GPU all_reduce done one-shot; 0 = built-in default")
declare("LINKWISE_GPU_MAX_BLOCKS", 0, int, "thread blocks of the GPU collective kernels; 0 = built-in default")
declare("LINKWISE_GPU_REG", True, _bool, "register user GPU buffers (CUDA IPC) for large transfers")
declare("LINKWISE_GPU_REG_MIN", 4 << 20, _size,
        "GPU send/recv and all_gather this large move between registered user buffers")
declare("LINKWISE_GPU_BCAST_REG_MIN", 64 << 20, _size,
        "GPU broadcasts this large go as a chain between registered buffers (not while "
        "capturing a CUDA graph)")
declare("LINKWISE_GPU_CHAIN_PIECE", 0, _size,
        "piece of the copy-engine broadcast chain; 0 = size/8 within 2-32 MiB, the whole size on 2 ranks")
declare("LINKWISE_GPU_REG_REDUCE_MIN", 64 << 20, _size,
        "GPU all_reduce/reduce_scatter this large read peers' registered buffers directly")
declare("LINKWISE_GPU_REG_REDUCE_BLOCKS", 0, int,
        "blocks of that kernel; 0 = a quarter of the SMs (all_reduce), half (reduce_scatter)")
declare("LINKWISE_GPU_REG_CACHE_ENTRIES", 128, _count,
        "peers' registered allocations a GPU communicator keeps mapped (CUDA IPC) after the call "
        "that used them, least recently used closed first (a mapping keeps memory the peer "
        "freed allocated on its GPU); 0 = none")
declare("LINKWISE_GPU_REG_CACHE_BYTES", 4 << 30, _size,
        "bytes of peers' registered allocations a GPU communicator keeps mapped after the call "
        "that used them (as LINKWISE_GPU_REG_CACHE_ENTRIES); 0 = none")
# Read by the C++ engine itself (getenv), declared here for linkwise info.
declare("LINKWISE_GPU_LL_MAX", 256 << 10, int,
        "GPU all_reduce/broadcast up to this many bytes (at most 262144) use the LL kernels; 0 = off")
declare("LINKWISE_GPU_BCAST_ALGO", "", str,
        "registered-buffer GPU broadcast: 'dchain' = work-claiming push chain in one kernel (any "
        "ranks; the default); 'pchain' = push chain with a fixed slice per block; 'chain' = the "
        "copy-engine chain; from 3 ranks 'push' = one-kernel push scatter-allgather, 'pull' = "
        "two-stream copy-engine pull scatter-allgather")
declare("LINKWISE_GPU_PCHAIN_BLOCKS", 0, int,
        "tuning: blocks of the push-chain broadcast kernel (at most 256); 0 = 32 below 128 MiB, 64 from it")
declare("LINKWISE_GPU_PCHAIN_SLICE", 0, int,
        "tuning: bytes (a plain number) per block per piece of the push-chain broadcast; 0 = 64 KiB "
        "below 128 MiB, 128 KiB from it")
declare("LINKWISE_GPU_PCHAIN_THREADS", 512, int,
        "tuning: threads per block of the push-chain broadcast, 512 or 1024 (read natively)")
declare("LINKWISE_GPU_PCHAIN_TRACE", 0, int,
        "diagnostics: 1 = the push-chain broadcast stamps per-block progress (GpuEngine::pchain_trace)")
declare("LINKWISE_GPU_DCHAIN_BLOCKS", 32, int,
        "tuning: blocks of the work-claiming chain broadcast (read natively, at most 1024)")
declare("LINKWISE_GPU_DCHAIN_ITEM", 128 << 10, int,
        "tuning: bytes per claimed item of the work-claiming chain broadcast (rounded up to 4096, and "
        "to at least the size / the items kept)")
declare("LINKWISE_GPU_DCHAIN_THREADS", 1024, int,
        "tuning: threads per block of the work-claiming chain broadcast, 1024 or 512")
declare("LINKWISE_GPU_AR_ALGO", "", str,
        "large registered GPU all_reduce: 'rsag' = registered reduce_scatter then all_gather, "
        "'direct' = the one-kernel form, 'prs' = push reduce-scatter + push all-gather in one "
        "kernel (reg_prs.cu); prs and rsag apply at any size (registered path; not under capture "
        "or LINKWISE_GPU_REG=0); empty = prs on 2 ranks from LINKWISE_GPU_AR_PRS_MIN bytes, else "
        "rsag from LINKWISE_GPU_AR_RSAG_MIN bytes, else the one-kernel form")
declare("LINKWISE_GPU_AR_PRS_MIN", 64 << 20, _size,
        "GPU all_reduce on 2 ranks as the prs kernel (push reduce-scatter + push all-gather) from "
        "this many bytes, when LINKWISE_GPU_AR_ALGO is empty")
declare("LINKWISE_GPU_PRS_BLOCKS", 48, int, "tuning: blocks of the prs all_reduce kernel")
declare("LINKWISE_GPU_PRS_ITEM", 192 << 10, int,
        "tuning: bytes (a plain number, rounded up to 4096, at most 1 MiB) per prs all_reduce item")
declare("LINKWISE_GPU_PRS_LAG", 2, int,
        "tuning: steps (0-4) the prs all_reduce's reductions trail its sends")
declare("LINKWISE_GPU_AR_RSAG_MIN", 512 << 20, _size,
        "GPU all_reduce as registered reduce_scatter + all_gather from this many bytes (count "
        "divisible by the ranks)")
declare("LINKWISE_GPU_BCAST_ROUNDS", 8, int, "rounds of the push / pull scatter-allgather broadcast")
declare("LINKWISE_GPU_BCAST_BLOCKS", 128, int, "tuning: blocks of the push broadcast kernel")
declare("LINKWISE_GPU_BCAST_UNROLL", 4, int, "tuning: 16-byte loads in flight per thread in the push broadcast (4, 8)")
declare("LINKWISE_GPU_REG_REDUCE_UNROLL", 2, int, "tuning: registered all_reduce kernel variant (1, 2, 4)")
# Read by the engine only under LINKWISE_GPU_TUNE=1 (sweeps; bench/gpu_ll_sweep.py, gpu_tune.py).
declare("LINKWISE_GPU_LL_THREADS", 64, int, "tuning: threads per block of the LL kernels (64-256)")
declare("LINKWISE_GPU_LL_BLOCKS", 128, int, "tuning: most blocks of an LL kernel")
declare("LINKWISE_GPU_LL_VARIANT", 47, int,
        "tuning: LL/LL128 kernel switches, bits 1 atomic epoch, 2 deferred announce, 4 warp "
        "layout, 8 PDL, 16 warp-1 announce, 32 spare announce block")
declare("LINKWISE_GPU_LL_TWOPHASE_MIN", 192 << 10, int,
        "tuning: LL/LL128 all_reduce of 5+ ranks this large runs as reduce-scatter + all-gather "
        "(3-4 ranks: never by default)")
declare("LINKWISE_GPU_LL_BCAST2_MIN", 192 << 10, int,
        "tuning: LL broadcast of 3+ ranks this large runs as scatter + all-gather")
declare("LINKWISE_GPU_LL128_MIN", 1 << 30, int,
        "tuning: LL all_reduce this large uses 128-byte LL128 lines (relies on NVLink "
        "delivering a warp's 128-byte store whole, as NCCL's LL128); engine default: 32 KiB "
        "on 2 ranks, off (this value) on 3+ ranks until tested there (csrc/cuda/ll128.cuh)")
declare("LINKWISE_GPU_LL128_BCAST_MIN", 1 << 30, int,
        "tuning: LL broadcast this large uses LL128 lines (default off: slower than LL on 2 "
        "ranks; on 4 ranks eager stalls were seen at 256 KiB before the sixth-session fix)")
declare("LINKWISE_GPU_LL128_THREADS", 64, int, "tuning: threads per block of the LL128 kernels (64-256)")
declare("LINKWISE_GPU_LL128_BLOCKS", 1024, int, "tuning: most blocks of an LL128 kernel")
declare("LINKWISE_GPU_ONESHOT_BLOCK_BYTES", 8192, int, "tuning: bytes per block of the one-shot flag kernel")
declare("LINKWISE_GPU_TUNE", False, _bool,
        "tuning: re-read LINKWISE_GPU_LL_MAX / _LL_THREADS / _LL_BLOCKS / _LL_VARIANT / "
        "_LL_TWOPHASE_MIN / _LL_BCAST2_MIN / _LL128_* / _ONESHOT_BLOCK_BYTES at every call")
declare("LINKWISE_STAGED_BUFFERS", 3, int, "pinned chunks in flight on the host-staged GPU path (2-16)")
declare("LINKWISE_STAGED_SHM", True, _bool,
        "host-staged GPU transfers within a host go through shared pinned memory (no CPU copy)")
