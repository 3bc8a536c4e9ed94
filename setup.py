"""Build the C parts: the cffi module ``sandboxns._sbx`` and the holder
program ``sandboxns/sandboxns-holder`` that each session execs."""

import os

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import LinkError

HOLDER_SOURCES = [
    "csrc/holder.c",
    "csrc/userns.c",
    "csrc/rootfs.c",
    "csrc/overlay.c",
    "csrc/net.c",
    "csrc/spawn.c",
    "csrc/serve.c",
    "csrc/report.c",
    "csrc/fds.c",
    "csrc/seccomp.c",
    "csrc/filter.c",
    "csrc/limits.c",
    "csrc/bwrap_init.c",
    "csrc/enter.c",
    "csrc/idmap.c",
    "csrc/text_file.c",
]
HOLDER_NAME = "sandboxns-holder"
HOLDER_CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror"]


class build_ext_with_holder(build_ext):
    """build_ext that also compiles and links the holder executable."""

    def run(self):
        super().run()
        self.build_holder()

    def build_holder(self):
        # After run(), self.compiler is the customised compiler that built
        # the extension; it links executables just as well.
        compiler = self.compiler
        objects = compiler.compile(HOLDER_SOURCES, output_dir=self.build_temp, extra_postargs=HOLDER_CFLAGS)
        package_dir = "sandboxns" if self.inplace else os.path.join(self.build_lib, "sandboxns")
        # Static where the C library allows it: every command's init is a
        # fork of the holder, and a static holder has fewer mappings to copy
        # (one A/B run: about 0.05 off the native/bare latency ratio).
        try:
            compiler.link_executable(objects, HOLDER_NAME, output_dir=package_dir, extra_postargs=["-static"])
        except LinkError:
            compiler.link_executable(objects, HOLDER_NAME, output_dir=package_dir)


setup(
    cffi_modules=["csrc/build_ffi.py:ffibuilder"],
    cmdclass={"build_ext": build_ext_with_holder},
)
