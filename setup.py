"""Build the pybind11 extension ``rtpcore_native._core``; metadata lives in pyproject.toml."""

import tomllib
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = Path(__file__).parent
VERSION = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]["version"]

ext_modules = [
    Pybind11Extension(
        "rtpcore_native._core",
        ["src/rtpcore_native/_core.cpp"],
        define_macros=[("RTPCORE_NATIVE_VERSION", f'"{VERSION}"')],
        cxx_std=17,
    ),
    # CPU decode kernels (float32, int8, bfloat16 and GGUF-quantized weights): compiled for
    # AVX-512, AVX2 (each with and without VNNI) and the baseline in one file and chosen at
    # first use by what the CPU and the OS offer (src/rtpcore_native/_kernels.cpp,
    # _cpu_features.hpp); -O3 for the vectorised loops.
    Pybind11Extension(
        "rtpcore_native._kernels",
        ["src/rtpcore_native/_kernels.cpp"],
        depends=["src/rtpcore_native/_kernels_isa.hpp", "src/rtpcore_native/_cpu_features.hpp",
                 "src/rtpcore_native/_bf16_isa.hpp", "src/rtpcore_native/_gguf_blocks.hpp",
                 "src/rtpcore_native/_gguf_isa.hpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
