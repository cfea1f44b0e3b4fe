"""Build the native shard-store extension (C core + Cython wrapper).

Metadata lives in pyproject.toml; this file only describes the compiled part,
because setuptools needs code to find numpy's headers and to cythonize.
"""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "native._shard",
        sources=["native/_shard.pyx", "native/shard.c"],
        include_dirs=["native", numpy.get_include()],
        extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(ext_modules=cythonize(extensions, language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False}))
