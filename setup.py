"""The build of kvactors' one native part; all metadata is in pyproject.toml.

``kvactors.transfer._streamcopy`` (the CPU copy loop of ``TransferEngine``) is
optional: without a C compiler the package installs without it, and the engine
copies with torch instead (``kvactors.transfer.native.native_copy_available``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvactors.transfer._streamcopy",
            sources=["kvactors/transfer/_streamcopy.c"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
