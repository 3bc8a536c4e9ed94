/* Thin wrappers for the system calls the holder needs that older C libraries
 * do not wrap (new mount API, clone3, pidfds, close_range). The numbers come
 * from the kernel headers through <sys/syscall.h>. */
#ifndef SBX_SYSCALLS_H
#define SBX_SYSCALLS_H

#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC 02000000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#define MOUNT_ATTR_NOSUID 0x00000002
#define MOUNT_ATTR_NODEV 0x00000004
#define MOUNT_ATTR_NOEXEC 0x00000008
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef FSCONFIG_SET_FLAG
#define FSCONFIG_SET_FLAG 0
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_SET_FD 5
#define FSCONFIG_CMD_CREATE 6
#endif
#ifndef FSOPEN_CLOEXEC
#define FSOPEN_CLOEXEC 0x00000001
#define FSMOUNT_CLOEXEC 0x00000001
#endif
#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif

/* Same layout as the kernel's struct mount_attr / clone_args (version 0). */
struct sbx_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

struct sbx_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
};

static inline int sys_open_tree(int dirfd, const char *path, unsigned int flags)
{
    return (int)syscall(SYS_open_tree, dirfd, path, flags);
}

static inline int sys_move_mount(int from_dirfd, const char *from_path, int to_dirfd,
                                 const char *to_path, unsigned int flags)
{
    return (int)syscall(SYS_move_mount, from_dirfd, from_path, to_dirfd, to_path, flags);
}

static inline int sys_mount_setattr(int dirfd, const char *path, unsigned int flags,
                                    uint64_t attr_set)
{
    struct sbx_mount_attr attr = {.attr_set = attr_set};
    return (int)syscall(SYS_mount_setattr, dirfd, path, flags, &attr, sizeof attr);
}

/* Make the detached tree at fd show the ids of userns_fd's map: a file owned
 * by inside id N on disk appears owned by the map's outside id for N. */
static inline int sys_mount_idmap(int fd, uint64_t attr_set, int userns_fd)
{
    struct sbx_mount_attr attr = {.attr_set = attr_set | MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns_fd};
    return (int)syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr);
}

static inline int sys_fsopen(const char *fstype, unsigned int flags)
{
    return (int)syscall(SYS_fsopen, fstype, flags);
}

static inline int sys_fsconfig(int fd, unsigned int cmd, const char *key, const void *value, int aux)
{
    return (int)syscall(SYS_fsconfig, fd, cmd, key, value, aux);
}

static inline int sys_fsmount(int fd, unsigned int flags, unsigned int attr_flags)
{
    return (int)syscall(SYS_fsmount, fd, flags, attr_flags);
}

static inline int sys_pivot_root(const char *new_root, const char *put_old)
{
    return (int)syscall(SYS_pivot_root, new_root, put_old);
}

/* fork() into new namespaces, returning a pidfd for the child atomically. */
static inline pid_t sys_clone3_fork(uint64_t flags, int *pidfd)
{
    struct sbx_clone_args args = {
        .flags = flags | CLONE_PIDFD,
        .pidfd = (uint64_t)(uintptr_t)pidfd,
        .exit_signal = SIGCHLD,
    };
    return (pid_t)syscall(SYS_clone3, &args, sizeof args);
}

static inline int sys_pidfd_send_signal(int pidfd, int sig)
{
    return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0);
}

static inline int sys_close_range(unsigned int first, unsigned int last)
{
    return (int)syscall(SYS_close_range, first, last, 0);
}

#endif
