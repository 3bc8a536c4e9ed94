"""cffi builder for ``sandboxns._sbx`` (API mode, out-of-line).

The cdef declares only the narrow boundary: the holder launcher and the wire
structs, whose layouts and constants come from the compiler (``...``).
"""

import re
import subprocess
import sysconfig

from cffi import FFI

# Relative to the project root, where setup.py runs.
CSRC = "csrc"
WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def syscall_names() -> list[str]:
    """Every syscall this machine's headers number, as the compiler's
    preprocessor defines them: Python resolves names given to the seccomp
    option through these constants rather than a table of its own."""
    compiler = sysconfig.get_config_var("CC") or "cc"
    macros = subprocess.run(
        [*compiler.split(), "-dM", "-E", "-include", "sys/syscall.h", "-x", "c", "/dev/null"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(set(re.findall(r"^#define __NR_(\w+) ", macros, re.MULTILINE)))


ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define SBX_PROTO_VERSION ...
    #define SBX_MAX_REQUEST_STRINGS ...
    #define SBX_TMP_BYTES ...
    #define SBX_SHM_BYTES ...
    #define SBX_MAX_PASSED_FDS ...
    enum sbx_rlimit_index { SBX_RLIMIT_CPU, SBX_RLIMIT_AS, SBX_RLIMIT_FSIZE, SBX_RLIMIT_NOFILE, SBX_RLIMIT_NPROC,
                            SBX_NRLIMITS };
    #define SBX_RLIMIT_INHERIT ...
    enum sbx_request_fd { SBX_FD_REPLY, SBX_FD_STDIN, SBX_FD_STDOUT, SBX_FD_STDERR, SBX_NFDS };
    enum sbx_report_kind { SBX_REPORT_READY, SBX_REPORT_ERROR, SBX_REPORT_EXITED, SBX_REPORT_STARTED };

    enum sbx_request_kind { SBX_REQUEST_EXEC, SBX_REQUEST_RESTACK, SBX_REQUEST_REPLACE };
    struct sbx_exec_request {
        uint32_t version;
        uint32_t kind;
        uint32_t argc;
        uint32_t envc;
        uint32_t strings_len;
        uint64_t rlimits[...];
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

    int sbx_spawn_holder(const char *path, char *const argv[], int control_fd, int lease_fd, int cgroup_procs_fd);

    #define RESOLVE_BENEATH ...
    #define RESOLVE_NO_MAGICLINKS ...
    #define RESOLVE_NO_SYMLINKS ...
    int sbx_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve);
    int sbx_set_fs_ids(unsigned int uid, unsigned int gid);
    int sbx_exchange(const char *a, const char *b);
    int sbx_make_userns(const char *uid_map, const char *gid_map, int owner_uid, int owner_gid);
    int sbx_idmapped_mount_ns(const char *const *sources, const char *const *targets, const int *readonly, int n,
                              const int *idmap_userns_fds);
    int sbx_image_mount(const char *image, const char *target);
    int sbx_image_unmount(const char *target);

    #define SBX_SECCOMP_MAX_INSNS ...
    #define SBX_SECCOMP_MAX_EXTRA ...
    enum sbx_seccomp_group {
        SBX_SECCOMP_KERNEL, SBX_SECCOMP_KEYRING, SBX_SECCOMP_BPF, SBX_SECCOMP_PERF, SBX_SECCOMP_USERFAULTFD,
        SBX_SECCOMP_IO_URING, SBX_SECCOMP_PTRACE, SBX_SECCOMP_FILE_HANDLES, SBX_SECCOMP_MOUNT,
        SBX_SECCOMP_NAMESPACES, SBX_SECCOMP_PERSONALITY, SBX_SECCOMP_TTY_INJECTION, SBX_SECCOMP_SETID_FILES
    };
    int sbx_seccomp_export(unsigned char *out, size_t size, uint32_t relaxed, const uint32_t *extra_denied,
                           size_t nextra_denied);
    """
    + "".join(f"#define __NR_{name} ...\n" for name in syscall_names())
)
ffibuilder.set_source(
    "sandboxns._sbx",
    '#include <linux/openat2.h>\n#include <sys/syscall.h>\n#include "sbx_ffi.h"\n#include "sbx_seccomp.h"',
    sources=[f"{CSRC}/{name}.c" for name in ("ffi_spawn", "ffi_files", "ffi_idmap", "ffi_image", "idmap", "seccomp", "text_file")],
    include_dirs=[CSRC],
    extra_compile_args=WARNINGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
