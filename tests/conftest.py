import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _have_gpu() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return False


def _why_no_gpu_tests() -> str:
    """Empty when the GPU tests can run: a GPU (seen through NVML, nvidia-ml-py of the test
    extra) and torch, which makes their arrays."""
    if not _have_gpu():
        return "no CUDA GPU on this machine"
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return "the GPU tests need torch (pip install torch)"
    return ""


def pytest_collection_modifyitems(config, items):
    why = _why_no_gpu_tests()
    if not why:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shm_clean():
    """Asserts the test leaves no segment of its own jobs in /dev/shm (run_ranks names them)."""
    from multirank import shm_of_this_process
    before = set(shm_of_this_process())
    yield
    after = set(shm_of_this_process()) - before
    assert not after, f"shared memory left behind: {sorted(after)}"


@pytest.fixture(params=["shm", "tcp"])
def transport_env(request):
    """Runs a test over shared memory and over forced TCP."""
    return {"LINKWISE_TRANSPORT": request.param}
