"""``linkwise bench``: OSU-style point-to-point and nccl-tests-style collective benchmarks,
with side-by-side runs of Gloo (torch.distributed) and MPI (mpi4py).

Modules: ``cli`` (flags and orchestration), ``runner`` (what each rank runs), ``p2p`` and
``collective`` (the timing loops), ``backends`` (the interface and linkwise's side),
``compare`` (Gloo, MPI), ``spawn`` (starting ranks), ``report`` (tables, JSON, plots),
``common`` (sizes, types, busbw factors).
"""
from .common import busbw_factor

__all__ = ["busbw_factor"]
