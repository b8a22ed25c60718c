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
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
