"""cffi builder for ``sandboxns._sbx`` (API mode, out-of-line).

The cdef declares only the narrow boundary: the holder launcher and the wire
structs, whose layouts and constants come from the compiler (``...``).
"""

from cffi import FFI

# Relative to the project root, where setup.py runs.
CSRC = "csrc"
WARNINGS = ["-Wall", "-Wextra", "-Werror"]

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define SBX_PROTO_VERSION ...
    #define SBX_MAX_REQUEST_STRINGS ...
    #define SBX_TMP_BYTES ...
    #define SBX_SHM_BYTES ...
    enum sbx_request_fd { SBX_FD_REPLY, SBX_FD_STDIN, SBX_FD_STDOUT, SBX_FD_STDERR, SBX_NFDS };
    enum sbx_report_kind { SBX_REPORT_READY, SBX_REPORT_ERROR, SBX_REPORT_EXITED, SBX_REPORT_STARTED };

    struct sbx_exec_request {
        uint32_t version;
        uint32_t argc;
        uint32_t envc;
        uint32_t strings_len;
        ...;
    };
    struct sbx_report {
        uint32_t kind;
        int32_t exit_code;
        int32_t signal;
        int32_t err;
        int32_t pid;
        char step[...];
        char message[...];
        ...;
    };
    struct sbx_signal_request {
        int32_t signal;
        ...;
    };

    int sbx_spawn_holder(const char *path, char *const argv[], int control_fd, int lease_fd);

    #define RESOLVE_BENEATH ...
    #define RESOLVE_NO_MAGICLINKS ...
    #define RESOLVE_NO_SYMLINKS ...
    int sbx_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve);

    #define SBX_SECCOMP_MAX_INSNS ...
    int sbx_seccomp_export(unsigned char *out, size_t size);
    """
)
ffibuilder.set_source(
    "sandboxns._sbx",
    '#include <linux/openat2.h>\n#include "sbx_ffi.h"\n#include "sbx_seccomp.h"',
    sources=[f"{CSRC}/ffi_spawn.c", f"{CSRC}/ffi_files.c", f"{CSRC}/seccomp.c"],
    include_dirs=[CSRC],
    extra_compile_args=WARNINGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
