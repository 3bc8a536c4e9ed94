/* The host side of the C boundary (compiled into the cffi module): starting
 * a session's holder. Python cannot do this itself because the holder must
 * get PR_SET_PDEATHSIG between fork and exec. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sbx_ffi.h"

/* Move fd `from` out of the way of the fixed fds 0-4 the holder expects (its
 * number may be any of them if the host had some closed). The copy is
 * closed by the close_range before exec. */
static int lift_fd(int from)
{
    return fcntl(from, F_DUPFD, SBX_HOLDER_LEASE_FD + 1);
}

/* The holder's launcher gets SIGTERM when we die (it then kills the session
 * and waits for it to be gone; see holder.c). lease_fd, unless -1, becomes
 * its fd SBX_HOLDER_LEASE_FD. cgroup_procs_fd, unless -1, is a session
 * cgroup's cgroup.procs: the child moves itself there before its execve, so
 * the holder and everything it ever starts are in it from the first
 * instruction (what clone3's CLONE_INTO_CGROUP does, without giving up
 * vfork).
 *
 * The parent-death signal fires when the *thread* that forked the holder
 * exits, not the process: call this from a thread that lives as long as the
 * session (the trio thread), never from a worker pool.
 *
 * vfork shares our memory until execve, so the child reports a failure by
 * writing child_errno, which the parent reads once vfork returns, and it
 * must not change any variable the parent uses afterwards. */
int sbx_spawn_holder(const char *path, char *const argv[], int control_fd, int lease_fd, int cgroup_procs_fd)
{
    static char *const empty_env[] = {NULL};
    volatile int child_errno = 0;
    pid_t parent = getpid();
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    pid_t pid;

    if (devnull < 0)
        return -errno;
    pid = vfork();
    if (pid == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0) < 0)
            goto child_fail;
        if (getppid() != parent) { /* the host died already */
            errno = ESRCH;
            goto child_fail;
        }
        if (cgroup_procs_fd >= 0 && write(cgroup_procs_fd, "0", 1) != 1)
            goto child_fail;
        /* New variables: the parent's own still hold its fd numbers. */
        int control = lift_fd(control_fd), lease = lease_fd >= 0 ? lift_fd(lease_fd) : -1;
        int null = lift_fd(devnull);

        if (control < 0 || (lease_fd >= 0 && lease < 0) || null < 0)
            goto child_fail;
        if (dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0 ||
            dup2(control, SBX_HOLDER_CONTROL_FD) < 0 || (lease >= 0 && dup2(lease, SBX_HOLDER_LEASE_FD) < 0))
            goto child_fail;
        syscall(SYS_close_range, lease_fd >= 0 ? SBX_HOLDER_LEASE_FD + 1 : SBX_HOLDER_CONTROL_FD + 1, ~0U, 0);
        execve(path, argv, empty_env);
    child_fail:
        child_errno = errno;
        _exit(127);
    }
    close(devnull);
    if (pid < 0)
        return -errno;
    if (child_errno) {
        int err = child_errno;
        waitpid(pid, NULL, 0);
        return -err;
    }
    return pid;
}
