"""Every module of the package imports on a machine without a GPU: the GPU modules are imported
only where CUDA runs, so a syntax or import error in them would otherwise reach CI unseen (a
misplaced ``from __future__`` in cuda/sendrecv.py did, once)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import linkwise

MODULES = sorted(m.name for m in pkgutil.walk_packages(linkwise.__path__, "linkwise."))


def test_the_package_has_its_modules():
    assert {"linkwise.cuda.sendrecv", "linkwise.cuda.gpu_comm", "linkwise.topo.probe"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name):
    if name == "linkwise.dask_comm":
        pytest.importorskip("distributed")
    importlib.import_module(name)
