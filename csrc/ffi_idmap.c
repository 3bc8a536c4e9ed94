/* The host side of idmap.c for the bwrap driver of a root host: the user
 * namespace its bwraps enter, and the mount namespace they start in. */
#define _GNU_SOURCE
#include <errno.h>
#include <unistd.h>

#include "idmap.h"
#include "sbx_ffi.h"
#include "syscalls.h"

/* Owned by owner_uid/gid (-1: by us): bwrap, running as the owner, may
 * enter it. */
int sbx_make_userns(const char *uid_map, const char *gid_map, int owner_uid, int owner_gid)
{
    return idmap_make_userns(uid_map, gid_map, 1, owner_uid, owner_gid);
}

/* A mount namespace where each of targets shows the tree at sources[i],
 * with its files through the maps of idmap_userns_fds[i] (read-only where
 * readonly[i]). */
int sbx_idmapped_mount_ns(const char *const *sources, const char *const *targets, const int *readonly, int n,
                          const int *idmap_userns_fds)
{
    int fds[16] = {0}, rc = 0, made = 0;

    if (n > (int)(sizeof fds / sizeof fds[0]))
        return -E2BIG;
    for (; made < n; made++) {
        fds[made] = idmap_clone_tree(sources[made], readonly[made] ? MOUNT_ATTR_RDONLY : 0,
                                       idmap_userns_fds[made]);
        if (fds[made] < 0) {
            rc = fds[made];
            break;
        }
    }
    if (rc == 0)
        rc = idmap_mount_ns(targets, fds, n);
    while (made > 0)
        close(fds[--made]);
    return rc;
}
