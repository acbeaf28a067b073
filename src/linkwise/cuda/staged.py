"""Host-staged GPU path: device -> pinned host -> the CPU engine -> pinned host -> device.

Used when the GPUs cannot map each other's memory (``LINKWISE_P2P_DISABLE=1``, peers on
another host, a VM without P2P). Pipeline (all_reduce, broadcast, send/recv): the array is cut
into chunks of ``LINKWISE_CHUNK_SIZE`` bytes (default 4 MiB here) staged through
``LINKWISE_STAGED_BUFFERS`` (default 3) pinned buffers. Device->host copies of the next chunks
are enqueued on the stream ahead, so they run while the CPU engine moves the current chunk;
the host->device copy of a chunk is enqueued on the same stream right after, so stream order
alone keeps a buffer from being refilled before it has been copied out. all_gather,
reduce_scatter and all_to_all stage the whole array once (no pipelining).

When every peer is on this host, all_reduce skips the CPU engine too: a StageReduce
(csrc/cuda/stage_reduce.h) pipelines device->host copies into shared pinned memory, a
reduce-scatter on the CPUs (rank r reduces part r of every chunk, float16/bfloat16 in float32,
so results match the NVLink path bitwise) and host->device copies of every rank's part.

Peers on this host (the CPU engine links them through shared memory) skip the CPU engine for
send/recv and broadcast: the bytes go through a StageChannel (csrc/cuda/stage_channel.h), a
shared-memory segment pinned in every process, so the sender's device->host copy writes
straight into the memory the receivers' host->device copies read, chunk by chunk through
``LINKWISE_STAGED_BUFFERS`` slots of ``LINKWISE_CHUNK_SIZE`` bytes. The segments are anonymous
memfds (never in /dev/shm: nothing is left by a crash, and a container's 64 MiB /dev/shm does
not limit them); readers open them through the writer's /proc/<pid>/fd. Channels are made on
first use: send/recv per ordered pair (the sender creates the segment and tells the receiver
its name in a host message; the sender keeps the fd open while the channel lives, as it cannot
know when the receiver has opened it), broadcast per root (collective; the root closes the fd
after a barrier). ``LINKWISE_STAGED_SHM=0`` turns this off. A channel waiting for a peer
raises PeerError when the communicator's watchdog saw that peer die (gpu_comm.py). A rank that
refuses a call's arguments, or whose GPU plane stops for a failure of its own, stops every
channel it has (:meth:`Staged.stop`), so a peer waiting in one raises at once naming it
(CommAbortedError, PeerError) instead of at LINKWISE_TIMEOUT; a peer that has no channel with
it yet waits in a host exchange, which the refusal's host notice or the timeout ends.

Unlike the NVLink path these calls block the host until the data has gone through the CPU
engine (the last host->device copy is waited for too, so the pinned buffers are free). None
of them can be captured in a CUDA graph (GpuComm raises under capture).
"""
from __future__ import annotations

import ctypes

import numpy as np

from .. import config

_HOST_DT = {"float32": (np.float32, None), "float16": (np.float16, None),
            "bfloat16": (np.uint16, "bfloat16"), "int32": (np.int32, None),
            "float64": (np.float64, None), "int64": (np.int64, None)}
_TAG = (1 << 61) + 4242
_NAME_TAG = (1 << 61) + 4244  # host message naming a send/recv StageChannel segment
_NAME_BYTES = 160
_seq = [0]  # StageChannel segments made by this process (names must be unique)


class Staged:
    def __init__(self, g):
        self.g, self.e, self.comm = g, g._engine, g.comm
        self.chunk = config.get("LINKWISE_CHUNK_SIZE") or (4 << 20)  # "64K" too, as everywhere
        self.chunk = max(4096, self.chunk // 256 * 256)
        self.nbuf = min(16, max(2, config.get("LINKWISE_STAGED_BUFFERS")))
        self._bufs: list = []  # [ptr, nbytes]
        links = getattr(self.comm, "transports", None) or {}
        on = config.get("LINKWISE_STAGED_SHM")
        self._local = {p for p, k in links.items() if k == "shm"} if on else set()
        self._out: dict = {}   # dst -> StageChannel we write
        self._in: dict = {}    # src -> StageChannel we read
        self._bc: dict = {}    # root -> broadcast StageChannel
        self._red = None       # StageReduce (all_reduce among peers of this host), on first use

    def stop(self, failed: bool) -> int:
        """Stops every channel this rank has (stage_channel.h, "Stopping"): a peer waiting in
        one raises at once, CommAbortedError naming this rank (a refusal) or PeerError (failed).
        A refusal is noted on our own engine too, so this rank's GPU calls raise
        CommAbortedError from now on, as on the NVLink path; a failure already aborted it.
        Returns how many channels were stopped (0: no peer could be told)."""
        code = self.e.stop_code(failed)
        channels = (*self._out.values(), *self._in.values(), *self._bc.values())
        for ch in channels:
            ch.stop(code)
        if not failed:
            self.e.note_stop(code)
        return len(channels)

    # -- shared-memory channels (peers on this host) ----------------------------------------
    def _new_name(self, what: str) -> str:
        """A label for a new segment (shown in /proc/<pid>/maps; peers open it by ch.name)."""
        _seq[0] += 1
        job = getattr(self.comm, "job_id", "") or "nojob"
        return f"linkwise-{job}-stg-{what}-{_seq[0]}"

    def _channel(self, name: str, create: bool, readers: int = 1):
        from .. import _native
        return _native._StageChannel(name, create, readers, self.nbuf if create else 0,
                                     self.chunk if create else 0, self.g.device,
                                     float(self.comm.timeout), self.e)

    @staticmethod
    def _name_msg(ch) -> np.ndarray:
        raw = ch.name.encode()
        assert len(raw) < _NAME_BYTES, raw
        return np.frombuffer(raw.ljust(_NAME_BYTES, b"\0"), np.uint8).copy()

    def _chan_out(self, dst: int):
        ch = self._out.get(dst)
        if ch is None:
            ch = self._out[dst] = self._channel(self._new_name(f"{self.comm.rank}to{dst}"), True)
            self.comm.send(self._name_msg(ch), dst, _NAME_TAG)
        return ch

    def _chan_in(self, src: int):
        ch = self._in.get(src)
        if ch is None:
            msg = np.zeros(_NAME_BYTES, np.uint8)
            self.comm.recv(msg, src, _NAME_TAG)
            ch = self._in[src] = self._channel(msg.tobytes().rstrip(b"\0").decode(), False)
        return ch

    def _chan_bcast(self, root: int):
        ch = self._bc.get(root)
        if ch is None:
            me = self.comm.rank == root
            msg = np.zeros(_NAME_BYTES, np.uint8)
            if me:
                ch = self._channel(self._new_name(f"bc{root}"), True, readers=self.comm.size - 1)
                msg[:] = self._name_msg(ch)
            self.comm.broadcast(msg, root=root)
            if not me:
                ch = self._channel(msg.tobytes().rstrip(b"\0").decode(), False)
            self.comm.barrier()  # every reader has mapped it
            if me:
                ch.unlink()  # closes the memfd: no other process can open it from now on
            self._bc[root] = ch
        return ch

    def _all_local(self) -> bool:
        return self.comm.size > 1 and len(self._local) == self.comm.size - 1

    def _reducer(self):
        """The StageReduce of this communicator (collective on first use: every rank creates
        its segment, the names are all-gathered, each maps the others', then closes its fd)."""
        if self._red is None:
            from .. import _native
            red = _native._StageReduce(self.comm.rank, self.comm.size, self.nbuf, self.chunk,
                                       self.g.device, float(self.comm.timeout), self.e,
                                       self._new_name("ar"))
            rows = self.comm.all_gather(self._name_msg(red)).reshape(self.comm.size, _NAME_BYTES)
            red.attach([row.tobytes().rstrip(b"\0").decode() for row in rows])
            self.comm.barrier()  # every rank has mapped every segment
            red.unlink()
            self._red = red
        return self._red

    def close(self):
        self._red = None
        self._out, self._in, self._bc = {}, {}, {}  # unregisters and unmaps the channels
        for ptr, _ in self._bufs:
            self.e.host_free(ptr)
        self._bufs = []

    def _buf(self, i: int, nbytes: int):
        while len(self._bufs) <= i:
            self._bufs.append([0, 0])
        if self._bufs[i][1] < nbytes:
            if self._bufs[i][0]:
                self.e.host_free(self._bufs[i][0])
            self._bufs[i] = [self.e.host_alloc(nbytes), nbytes]
        return self._bufs[i][0]

    @staticmethod
    def _np(ptr: int, nbytes: int, dtype=np.uint8):
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr) if nbytes else bytearray(0)
        return np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dtype)

    def _chunks(self, nbytes: int, itemsize: int):
        step = max(itemsize, self.chunk // itemsize * itemsize)
        return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

    def _pipeline(self, src: int, dst: int, nbytes: int, itemsize: int, stream: int, body,
                  down: bool = True, up: bool = True, first_buf: int = 0):
        """For each chunk: [device src -> pinned] -> body(host view, k) -> [pinned -> device dst].
        Uses pinned buffers first_buf..first_buf + nbuf - 1: a send passes nbuf, so that it may
        run on another thread beside a receive (a host-staged sendrecv, cuda/sendrecv.py)."""
        e, B = self.e, self.nbuf
        chunks = self._chunks(nbytes, itemsize)
        bufs = [self._buf(first_buf + i, min(self.chunk, nbytes) + 256) for i in range(min(B, len(chunks)))]
        ready = {}

        def d2h(k):
            off, n = chunks[k]
            if down:
                e.copy_async(bufs[k % B], src + off, n, stream)
                ready[k] = e.event_record(stream)

        for k in range(min(B, len(chunks))):
            d2h(k)
        up_evs: dict = {}
        for k, (off, n) in enumerate(chunks):
            if down:
                e.event_sync(ready.pop(k))
            elif k >= B:  # receiving into a buffer whose previous chunk may still be copying up
                e.event_sync(up_evs.pop(k - B))
            body(bufs[k % B], n, k)
            if up:
                e.copy_async(dst + off, bufs[k % B], n, stream)
                if not down:
                    up_evs[k] = e.event_record(stream)
            if k + B < len(chunks):
                d2h(k + B)
        for ev in up_evs.values():
            e.event_sync(ev)
        if up and down:
            e.event_sync(e.event_record(stream))

    # -- operations -------------------------------------------------------------------------
    def all_reduce(self, v, o, op: str, stream: int):
        if self._all_local():  # shared pinned memory, no CPU engine (stage_reduce.h)
            if v.count:
                from .arrays import DTYPES, OPS
                self._reducer().all_reduce(v.ptr, o.ptr, v.count, DTYPES[v.dtype], OPS[op], stream)
            return
        dt, name = _HOST_DT[v.dtype]

        def body(ptr, n, k):
            self.comm.all_reduce(self._np(ptr, n, dt), op=op, dtype=name)
        self._pipeline(v.ptr, o.ptr, v.nbytes, v.itemsize, stream, body)

    def broadcast(self, v, root: int, stream: int):
        me = self.comm.rank == root
        if len(self._local) == self.comm.size - 1 and self.comm.size > 1:
            if v.nbytes:
                ch = self._chan_bcast(root)
                (ch.write if me else ch.read)(v.ptr, v.nbytes, stream)
            return

        def body(ptr, n, k):
            self.comm.broadcast(self._np(ptr, n), root=root)
        self._pipeline(v.ptr, v.ptr, v.nbytes, 1, stream, body, down=me, up=not me)

    def send(self, v, dst: int, stream: int):
        if dst in self._local:
            if v.nbytes:
                self._chan_out(dst).write(v.ptr, v.nbytes, stream)
            return
        def body(ptr, n, k):
            self.comm.send(self._np(ptr, n), dst, _TAG)
        self._pipeline(v.ptr, 0, v.nbytes, 1, stream, body, down=True, up=False, first_buf=self.nbuf)

    def recv(self, v, src: int, stream: int):
        if src in self._local:
            if v.nbytes:
                self._chan_in(src).read(v.ptr, v.nbytes, stream)
            return
        def body(ptr, n, k):
            self.comm.recv(self._np(ptr, n), src, _TAG)
        self._pipeline(0, v.ptr, v.nbytes, 1, stream, body, down=False, up=True)

    def _whole(self, v, o, stream: int, fn, dt=np.uint8):
        e = self.e
        a, b = self._buf(0, v.nbytes + 256), self._buf(1, o.nbytes + 256)
        e.copy_async(a, v.ptr, v.nbytes, stream)
        e.event_sync(e.event_record(stream))
        fn(self._np(a, v.nbytes, dt), self._np(b, o.nbytes, dt))
        e.copy_async(o.ptr, b, o.nbytes, stream)
        e.event_sync(e.event_record(stream))

    def all_gather(self, v, o, stream: int):
        self._whole(v, o, stream, lambda a, b: self.comm.all_gather(a, out=b))

    def all_to_all(self, v, o, stream: int):
        self._whole(v, o, stream, lambda a, b: self.comm.all_to_all(a, out=b))

    def reduce_scatter(self, v, o, op: str, stream: int):
        dt, name = _HOST_DT[v.dtype]
        self._whole(v, o, stream, lambda a, b: self.comm.reduce_scatter(a, op=op, out=b, dtype=name), dt)
