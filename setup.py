"""Builds diversed_ext._C: the verify and stats ops' CPU kernels always, their CUDA kernels when torch has CUDA and nvcc
is found, and the lean CPU forward (int8 and float products, Llama layers) unless DIVERSED_FORWARD=0 leaves it out.

Environment:
    DIVERSED_FORWARD=0  a verify-only library, what a server needs: csrc/forward/ (its ops and their schemas) not built
    DIVERSED_FORWARD=1  (or unset) the lean forward too
    DIVERSED_CUDA=1   require the CUDA kernels (fails with the reason when they cannot be built)
    DIVERSED_CUDA=0   CPU kernels only
    (unset)           CUDA when torch is a CUDA build and a real nvcc is found
    CUDA_HOME         toolkit root; when unset, the first root whose bin/nvcc is a real compiler (not a wrapper script)
    TORCH_CUDA_ARCH_LIST  defaults to "9.0+PTX" when no GPU is visible (torch cannot guess it then)
Install torch first, then: pip install --no-build-isolation .
The package's metadata, the supported Pythons (CPython 3.10 to 3.13: requires-python and the classifiers) among it,
is in pyproject.toml; setuptools reads it from there only.
"""

import glob
import os
import sys

from setuptools import find_namespace_packages, setup

CUDA_ROOT_CANDIDATES = ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
DEFAULT_ARCH_LIST = "9.0+PTX"


def _is_real_nvcc(path: str) -> bool:
    """A wrapper script on PATH would make torch guess the toolkit root wrongly; only an ELF binary will do."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"\x7fELF"
    except OSError:
        return False


def _find_cuda_home():
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return explicit if _is_real_nvcc(os.path.join(explicit, "bin", "nvcc")) else None
    for root in CUDA_ROOT_CANDIDATES:
        if _is_real_nvcc(os.path.join(root, "bin", "nvcc")):
            return os.path.realpath(root)
    return None


def _cuda_request() -> str:
    value = os.environ.get("DIVERSED_CUDA", "auto").strip().lower()
    if value not in ("0", "1", "auto"):
        sys.exit(f"DIVERSED_CUDA must be 0, 1 or auto, got {value!r}")
    return value


def _decide_cuda() -> bool:
    import torch

    request = _cuda_request()
    if request == "0":
        return False
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build (pip install torch==2.14.1 for CUDA 13.0)")
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        reasons.append("no real nvcc found: set CUDA_HOME to the toolkit root whose bin/nvcc is the compiler")
    if reasons:
        if request == "1":
            sys.exit("DIVERSED_CUDA=1 but the CUDA kernels cannot be built: " + "; ".join(reasons))
        print("diversed_ext: building CPU kernels only (" + "; ".join(reasons) + ")")
        return False
    os.environ["CUDA_HOME"] = cuda_home
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    print(f"diversed_ext: building CPU and CUDA kernels with CUDA_HOME={cuda_home}")
    return True


def _with_forward() -> bool:
    value = os.environ.get("DIVERSED_FORWARD", "1").strip()
    if value not in ("0", "1"):
        sys.exit(f"DIVERSED_FORWARD must be 0 or 1, got {value!r}")
    return value == "1"


def _extensions():
    with_cuda = _decide_cuda()
    # CUDA_HOME must be settled before torch.utils.cpp_extension reads it at import time.
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # The floors of the library: the verify and stats ops (csrc/ops.cpp's schemas, csrc/cpu/) and, in their own
    # schema fragment, the lean forward (csrc/forward/); csrc/common/ and csrc/cpu_base/ hold headers only.
    sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    if _with_forward():
        sources += sorted(glob.glob("csrc/forward/*.cpp"))
    else:
        print("diversed_ext: building the verify and stats ops only (DIVERSED_FORWARD=0)")
    # No fused multiply-add: the kernels must round like torch's separate elementwise ops (csrc/common/verify_math.h).
    # -fno-trapping-math changes no value, only FP exception flags, and lets gcc vectorise the selects of the
    # vocabulary loops (sanitising, max(0, p - q)); without it those loops stay scalar and branchy (3x slower).
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math",
                 "-fopenmp" if sys.platform.startswith("linux") else ""]
    cxx_flags = [flag for flag in cxx_flags if flag]
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        extension = CUDAExtension(
            "diversed_ext._C", sources,
            extra_compile_args={"cxx": cxx_flags + ["-DDIVERSED_WITH_CUDA"],
                                "nvcc": ["-O3", "--fmad=false", "-DDIVERSED_WITH_CUDA"]},
            py_limited_api=False)
    else:
        extension = CppExtension("diversed_ext._C", sources, extra_compile_args={"cxx": cxx_flags})
    # The tests' probes (the split CUDA kernels' steps, the CPU build chosen), in a library only the tests load.
    probes = CppExtension("diversed_ext._probes", sorted(glob.glob("csrc/probes/*.cpp")),
                          extra_compile_args={"cxx": cxx_flags})
    return [extension, probes], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    # Namespace discovery, so the data-only heads/ folders count as packages and carry their files.
    packages=find_namespace_packages(include=["diversed_ext", "diversed_ext.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
