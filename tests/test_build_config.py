"""The CUDA build's target architectures, as cmake configures them (needs nvcc and cmake).

Until the twenty-eighth session CMakeLists.txt set its sm_90 default after enable_language(CUDA)
had already filled the variable with nvcc's own default (sm_75): every GPU build was PTX that
the driver JIT-compiled at the first launch (~24 s on an H100) with the sm_90 code compiled out.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_cuda_toolchain = pytest.mark.skipif(
    not (shutil.which("nvcc") and shutil.which("cmake") and shutil.which("make") and (ROOT / "CMakeLists.txt").exists()),
    reason="configuring the CUDA part needs nvcc, cmake, make and the source tree")


def _configured_architectures(tmp_path, cudaarchs=None, define=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CUDAARCHS"}
    if cudaarchs is not None:
        env["CUDAARCHS"] = cudaarchs
    cmd = ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), "-G", "Unix Makefiles", "-DLINKWISE_CUDA=ON",
           f"-DPython_EXECUTABLE={sys.executable}"]
    if define is not None:
        cmd.append(f"-DCMAKE_CUDA_ARCHITECTURES={define}")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # What nvcc is asked for: the --generate-code=arch=compute_XX,... flags of the build.
    flags = (tmp_path / "b" / "CMakeFiles" / "linkwise_cuda.dir" / "flags.make").read_text()
    archs = sorted(set(re.findall(r"--generate-code=arch=compute_(\d+)", flags)), key=int)
    assert archs, out.stdout[-2000:]
    return ";".join(archs)


@needs_cuda_toolchain
@pytest.mark.parametrize("cudaarchs, define, want", [
    (None, None, "90"),          # the default: Hopper, not nvcc's
    ("80;90", None, "80;90"),    # the CUDAARCHS environment variable wins
    (None, "86", "86"),          # and so does -DCMAKE_CUDA_ARCHITECTURES
])
def test_cuda_architectures(tmp_path, cudaarchs, define, want):
    assert _configured_architectures(tmp_path, cudaarchs, define) == want
