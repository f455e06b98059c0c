"""Builds the native n-gram corpus (C++17, pybind11) as ``spectool._native``."""

import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# The sources compile one per core (SPECTOOL_BUILD_JOBS=N to choose): on a 2-core machine this halves the
# build that `pip install .` waits for.
ParallelCompile("SPECTOOL_BUILD_JOBS", default=0).install()

extra = ["-O3", "-Wall", "-Wextra", "-Wpedantic"]
if os.environ.get("SPECTOOL_NATIVE_WERROR"):
    extra.append("-Werror")

setup(
    ext_modules=[
        Pybind11Extension(
            "spectool._native",
            sorted(os.path.join("native", f) for f in os.listdir("native") if f.endswith(".cpp")
                   and not f.startswith("test_")),
            include_dirs=["native"],
            cxx_std=17,
            extra_compile_args=extra,
        )
    ],
    cmdclass={"build_ext": build_ext},
)
