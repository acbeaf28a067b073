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


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
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
