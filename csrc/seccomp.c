/* The seccomp filter every guest command runs under.
 *
 * Namespaces decide what a guest can see; this decides which kernel
 * interfaces it can call at all. Denied: what manipulates the kernel or
 * other processes (modules, kexec, keyrings, bpf, perf, ptrace, process_vm_*,
 * pidfd_getfd, kcmp),
 * interfaces with a long record of exploitable bugs that sandboxed code has no
 * need for (userfaultfd, io_uring), mounting and namespace games (a guest has
 * no business creating namespaces; the holder made all it needs), terminal
 * injection (TIOCSTI, TIOCLINUX), set-id files (see mode_arguments), and
 * other ABIs on this machine (i386 entry points, x32 numbers), whose syscall
 * numbers this table does not describe.
 *
 * Most calls fail with EPERM. clone3 and the new mount API fail with ENOSYS:
 * their arguments cannot be inspected (clone3's live in memory) or libc
 * probes them and falls back, so "not implemented" is the answer that keeps
 * ordinary programs working (glibc's posix_spawn retries with clone).
 *
 * The program is generated from the table below: one comparison per entry.
 * bwrap gets the program whole (--seccomp); the native driver installs it
 * in two parts (see enum sbx_seccomp_part), which together deny the same.
 * A host may lift groups of the table (a debugger needs ptrace) and deny
 * more calls by number; the ABI checks always stay. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <termios.h>

#include "sbx_seccomp.h"

#if defined(__x86_64__)
#define SBX_AUDIT_ARCH AUDIT_ARCH_X86_64
#define SBX_X32_SYSCALL_BIT 0x40000000u
#elif defined(__aarch64__)
#define SBX_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "sandboxns's seccomp table covers x86_64 and aarch64"
#endif

#ifndef TIOCLINUX
#define TIOCLINUX 0x541C
#endif
#ifndef __NR_fchmodat2
#define __NR_fchmodat2 452 /* Linux 6.6, the same number on both */
#endif

struct denied {
    int nr;
    int err;
    unsigned group; /* enum sbx_seccomp_group: what a host may relax */
};

static const struct denied denied[] = {
    /* The kernel itself. */
    {__NR_init_module, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_finit_module, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_delete_module, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_kexec_load, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_kexec_file_load, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_reboot, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_swapon, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_swapoff, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_syslog, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_acct, EPERM, SBX_SECCOMP_KERNEL},
    {__NR_quotactl, EPERM, SBX_SECCOMP_KERNEL},
#ifdef __NR_quotactl_fd
    {__NR_quotactl_fd, EPERM, SBX_SECCOMP_KERNEL},
#endif
    {__NR_keyctl, EPERM, SBX_SECCOMP_KEYRING},
    {__NR_add_key, EPERM, SBX_SECCOMP_KEYRING},
    {__NR_request_key, EPERM, SBX_SECCOMP_KEYRING},
    {__NR_bpf, EPERM, SBX_SECCOMP_BPF},
    {__NR_perf_event_open, EPERM, SBX_SECCOMP_PERF},
    {__NR_userfaultfd, EPERM, SBX_SECCOMP_USERFAULTFD},
    {__NR_io_uring_setup, EPERM, SBX_SECCOMP_IO_URING},
    {__NR_io_uring_enter, EPERM, SBX_SECCOMP_IO_URING},
    {__NR_io_uring_register, EPERM, SBX_SECCOMP_IO_URING},
    /* Other processes: their memory, their fds (pidfd_getfd takes one, kcmp
     * tells which they hold), and control of them. */
    {__NR_ptrace, EPERM, SBX_SECCOMP_PTRACE},
    {__NR_process_vm_readv, EPERM, SBX_SECCOMP_PTRACE},
    {__NR_process_vm_writev, EPERM, SBX_SECCOMP_PTRACE},
    {__NR_pidfd_getfd, EPERM, SBX_SECCOMP_PTRACE},
    {__NR_kcmp, EPERM, SBX_SECCOMP_PTRACE},
    /* Files by handle (a way around path-based confinement). */
    {__NR_open_by_handle_at, EPERM, SBX_SECCOMP_FILE_HANDLES},
    {__NR_name_to_handle_at, EPERM, SBX_SECCOMP_FILE_HANDLES},
    /* Mounts and namespaces. */
    {__NR_mount, EPERM, SBX_SECCOMP_MOUNT},
    {__NR_umount2, EPERM, SBX_SECCOMP_MOUNT},
    {__NR_pivot_root, EPERM, SBX_SECCOMP_MOUNT},
    {__NR_open_tree, ENOSYS, SBX_SECCOMP_MOUNT},
    {__NR_move_mount, ENOSYS, SBX_SECCOMP_MOUNT},
    {__NR_fsopen, ENOSYS, SBX_SECCOMP_MOUNT},
    {__NR_fsconfig, ENOSYS, SBX_SECCOMP_MOUNT},
    {__NR_fsmount, ENOSYS, SBX_SECCOMP_MOUNT},
    {__NR_fspick, ENOSYS, SBX_SECCOMP_MOUNT},
#ifdef __NR_mount_setattr
    {__NR_mount_setattr, ENOSYS, SBX_SECCOMP_MOUNT},
#endif
    {__NR_unshare, EPERM, SBX_SECCOMP_NAMESPACES},
    {__NR_setns, EPERM, SBX_SECCOMP_NAMESPACES},
    {__NR_clone3, ENOSYS, SBX_SECCOMP_NAMESPACES},
    /* Its file mode lives in memory (struct open_how), where no filter can
     * check it for set-id bits; libc does not need it (see below). */
    {__NR_openat2, ENOSYS, SBX_SECCOMP_SETID_FILES},
};

/* Calls that give a file a mode, and which argument holds it: no guest may
 * make a set-user-ID or set-group-ID file. The workspace outlives the
 * sandbox, and on a root host its files are root's on disk (see idmap.c):
 * a set-id file left there would run with its owner's rights for whoever
 * later runs it on the host. Directories may still be set-group-ID (mkdir
 * is not listed), which only passes their group on. */
struct mode_argument {
    int nr;
    int arg;
};

static const struct mode_argument mode_arguments[] = {
#ifdef __NR_chmod
    {__NR_chmod, 1},
#endif
    {__NR_fchmod, 1},
    {__NR_fchmodat, 2},
    {__NR_fchmodat2, 2},
#ifdef __NR_open
    {__NR_open, 2},
#endif
#ifdef __NR_creat
    {__NR_creat, 1},
#endif
    {__NR_openat, 3},
#ifdef __NR_mknod
    {__NR_mknod, 1},
#endif
    {__NR_mknodat, 2},
};

#define NS_FLAGS                                                                              \
    (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | \
     CLONE_NEWCGROUP)

#define LOAD(field) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, field))
/* The low 32 bits of argument n (little-endian on both architectures). */
#define LOAD_ARG_LOW(n) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[n]))
#define RETURN(value) BPF_STMT(BPF_RET | BPF_K, (value))
#define DENY(err) RETURN(SECCOMP_RET_ERRNO | ((err) & SECCOMP_RET_DATA))

static int in_part(enum sbx_seccomp_part part, unsigned group)
{
    switch (part) {
    case SBX_SECCOMP_SESSION_PART:
        return !(group & SBX_SECCOMP_COMMAND_GROUPS);
    case SBX_SECCOMP_COMMAND_PART:
        return !!(group & SBX_SECCOMP_COMMAND_GROUPS);
    default:
        return 1;
    }
}

size_t sbx_seccomp_program(struct sock_filter *out, size_t capacity, const struct sbx_seccomp_options *options)
{
    struct sock_filter program[SBX_SECCOMP_MAX_INSNS];
    size_t n = 0;

    /* Worst case: the fixed checks, two instructions per table entry and per
     * extra denial. */
    if (options->nextra_denied > SBX_SECCOMP_MAX_EXTRA)
        return 0;
#define EMIT(insn) (program[n++] = (struct sock_filter)insn)
#define KEPT(group) (!(options->relaxed & (group)) && in_part(options->part, group))
    /* Another ABI: numbers in this table mean nothing there. */
    EMIT(LOAD(arch));
    EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SBX_AUDIT_ARCH, 1, 0));
    EMIT(DENY(EPERM));
    EMIT(LOAD(nr));
#ifdef SBX_X32_SYSCALL_BIT
    EMIT(BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, SBX_X32_SYSCALL_BIT, 0, 1));
    EMIT(DENY(EPERM));
#endif
    for (size_t i = 0; options->part != SBX_SECCOMP_SESSION_PART && i < options->nextra_denied; i++) {
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, options->extra_denied[i], 0, 1));
        EMIT(DENY(EPERM));
    }
    for (size_t i = 0; i < sizeof denied / sizeof denied[0]; i++) {
        if (!KEPT(denied[i].group))
            continue;
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)denied[i].nr, 0, 1));
        EMIT(DENY(denied[i].err));
    }
    if (KEPT(SBX_SECCOMP_SETID_FILES)) {
        for (size_t i = 0; i < sizeof mode_arguments / sizeof mode_arguments[0]; i++) {
            EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)mode_arguments[i].nr, 0, 3));
            EMIT(LOAD_ARG_LOW(mode_arguments[i].arg));
            EMIT(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, S_ISUID | S_ISGID, 0, 1));
            EMIT(DENY(EPERM));
            EMIT(LOAD(nr));
        }
    }
    if (KEPT(SBX_SECCOMP_NAMESPACES)) {
        /* clone with any namespace flag (its flags are argument 0 on both). */
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 3));
        EMIT(LOAD_ARG_LOW(0));
        EMIT(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_FLAGS, 0, 1));
        EMIT(DENY(EPERM));
        EMIT(LOAD(nr));
    }
    if (KEPT(SBX_SECCOMP_TTY_INJECTION)) {
        /* ioctl TIOCSTI / TIOCLINUX, compared on the low 32 bits the kernel
         * uses, so a request with high bits set cannot slip past. */
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ioctl, 0, 4));
        EMIT(LOAD_ARG_LOW(1));
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TIOCSTI, 1, 0));
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TIOCLINUX, 0, 1));
        EMIT(DENY(EPERM));
        EMIT(LOAD(nr));
    }
    if (KEPT(SBX_SECCOMP_PERSONALITY)) {
        /* personality: only querying it or asking for plain Linux. */
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_personality, 0, 4));
        EMIT(LOAD_ARG_LOW(0));
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 2, 0));
        EMIT(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0xffffffffu, 1, 0));
        EMIT(DENY(EPERM));
    }
    EMIT(RETURN(SECCOMP_RET_ALLOW));
#undef KEPT
#undef EMIT
    if (n > capacity)
        return 0;
    memcpy(out, program, n * sizeof program[0]);
    return n;
}

int sbx_seccomp_export(unsigned char *out, size_t size, uint32_t relaxed, const uint32_t *extra_denied,
                       size_t nextra_denied)
{
    struct sock_filter program[SBX_SECCOMP_MAX_INSNS];
    struct sbx_seccomp_options options = {
        .relaxed = relaxed, .extra_denied = extra_denied, .nextra_denied = nextra_denied};
    size_t n = sbx_seccomp_program(program, SBX_SECCOMP_MAX_INSNS, &options);

    if (n == 0 || n * sizeof program[0] > size)
        return -ENOSPC;
    memcpy(out, program, n * sizeof program[0]);
    return (int)(n * sizeof program[0]);
}
