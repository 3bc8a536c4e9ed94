/* The host's contained file I/O. openat2(2): RESOLVE_BENEATH makes the
 * kernel refuse any path (through "..", an absolute symlink, or a symlink
 * that climbs out) that would leave the workspace directory, atomically with
 * the lookup, which no userspace check of the path can do. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <sys/fsuid.h>
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

/* The calling thread's file-system ids (setfsuid/setfsgid act on one thread
 * only): a root host's file operations on a workspace seen through an
 * idmapped mount run as the guest's host user, whose files they are there.
 * setfsuid reports no error, so the ids are read back to check. */
int sbx_set_fs_ids(unsigned int uid, unsigned int gid)
{
    setfsgid(gid);
    setfsuid(uid);
    if ((unsigned int)setfsgid((gid_t)-1) != gid || (unsigned int)setfsuid((uid_t)-1) != uid)
        return -EPERM;
    return 0;
}

/* Swap two names atomically (renameat2 RENAME_EXCHANGE): a record is
 * replaced by writing a spare file and exchanging it with the record, so
 * that no file is created or deleted, which ext4 makes slow after churn (its
 * inode allocator skips over recently deleted inodes, one by one), and no
 * rename lands over a file (ext4 then flushes the new one's data). */
int sbx_exchange(const char *a, const char *b)
{
    return renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) < 0 ? -errno : 0;
}
