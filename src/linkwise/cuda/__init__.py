"""GPU data plane: collectives and point-to-point on CUDA arrays over CUDA IPC / NVLink.

    from linkwise.cuda import gpu_comm
    g = gpu_comm(comm)            # built once per Communicator, on first use
    g.all_reduce(tensor)          # enqueued on the tensor's current stream; returns at once
"""
from .arrays import DTYPES, OPS, is_cuda_array
from .gpu_comm import GpuComm, available, gpu_comm, select_device

__all__ = ["GpuComm", "gpu_comm", "available", "select_device", "is_cuda_array", "DTYPES", "OPS"]
