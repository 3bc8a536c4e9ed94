/* openat2(2) for the host's contained file I/O: RESOLVE_BENEATH makes the
 * kernel refuse any path (through "..", an absolute symlink, or a symlink
 * that climbs out) that would leave the workspace directory, atomically with
 * the lookup, which no userspace check of the path can do. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sbx_ffi.h"

int sbx_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve)
{
    struct open_how how = {.flags = (unsigned long long)flags, .mode = (unsigned long long)mode, .resolve = resolve};
    long fd;

    do
        fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    while (fd < 0 && errno == EAGAIN); /* RESOLVE_CACHED is not used; EAGAIN means a rename race */
    return fd < 0 ? -errno : (int)fd;
}
