/* The guest's seccomp filter (seccomp.c), for the holder and, through the
 * Python extension, for bwrap's --seccomp. */
#ifndef SBX_SECCOMP_H
#define SBX_SECCOMP_H

#include <linux/filter.h>
#include <stddef.h>
#include <stdint.h>

#define SBX_SECCOMP_MAX_INSNS 512
/* Syscalls a host may deny on top of the table. */
#define SBX_SECCOMP_MAX_EXTRA 64

/* The table's groups: a host may lift any of them. */
enum sbx_seccomp_group {
    SBX_SECCOMP_KERNEL = 1 << 0,        /* modules, kexec, reboot, swap, syslog, acct, quotas */
    SBX_SECCOMP_KEYRING = 1 << 1,       /* keyctl, add_key, request_key */
    SBX_SECCOMP_BPF = 1 << 2,
    SBX_SECCOMP_PERF = 1 << 3,          /* perf_event_open */
    SBX_SECCOMP_USERFAULTFD = 1 << 4,
    SBX_SECCOMP_IO_URING = 1 << 5,
    SBX_SECCOMP_PTRACE = 1 << 6,        /* ptrace, process_vm_readv/writev */
    SBX_SECCOMP_FILE_HANDLES = 1 << 7,  /* open_by_handle_at, name_to_handle_at */
    SBX_SECCOMP_MOUNT = 1 << 8,         /* mount, umount2, pivot_root, the new mount API */
    SBX_SECCOMP_NAMESPACES = 1 << 9,    /* unshare, setns, clone3, clone with namespace flags */
    SBX_SECCOMP_PERSONALITY = 1 << 10,  /* personality other than querying or plain Linux */
    SBX_SECCOMP_TTY_INJECTION = 1 << 11, /* ioctl TIOCSTI, TIOCLINUX */
    SBX_SECCOMP_SETID_FILES = 1 << 12,  /* set-user/group-ID modes on files; openat2 */
};

/* Which part of the filter a program holds. bwrap installs the whole
 * filter in one. The native driver stacks two (the kernel runs every filter
 * a process has, and the strictest answer wins): the holder installs the
 * session part once, before it serves requests; each command's init adds
 * the command part, the groups the holder still needs itself to make every
 * command's namespaces and mounts, plus the host's extra denials (which may
 * name anything, including what the holder calls). Loading a filter costs
 * in proportion to its length (the kernel checks it, converts it, works out
 * which syscalls it always allows, and JIT-compiles it), so each command
 * loads a short program rather than the whole table. */
enum sbx_seccomp_part {
    SBX_SECCOMP_WHOLE = 0,
    SBX_SECCOMP_SESSION_PART = 1,
    SBX_SECCOMP_COMMAND_PART = 2,
};
#define SBX_SECCOMP_COMMAND_GROUPS (SBX_SECCOMP_MOUNT | SBX_SECCOMP_NAMESPACES)

struct sbx_seccomp_options {
    enum sbx_seccomp_part part;
    uint32_t relaxed;              /* groups (enum sbx_seccomp_group) to allow */
    const uint32_t *extra_denied;  /* syscall numbers denied with EPERM */
    size_t nextra_denied;          /* at most SBX_SECCOMP_MAX_EXTRA */
};

/* Writes the program into out; returns its length in instructions, or 0 if
 * it does not fit in capacity or options ask for too much. */
size_t sbx_seccomp_program(struct sock_filter *out, size_t capacity, const struct sbx_seccomp_options *options);

/* The program as bytes (what bwrap --seccomp reads); returns their number,
 * or -ENOSPC. */
int sbx_seccomp_export(unsigned char *out, size_t size, uint32_t relaxed, const uint32_t *extra_denied,
                       size_t nextra_denied);

#endif
