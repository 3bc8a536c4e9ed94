/* The host side of idmap.c for the bwrap driver of a root host: the user
 * namespace its bwraps enter, and the mount namespace they start in. */
#define _GNU_SOURCE
#include <errno.h>
#include <unistd.h>

#include "idmap.h"
#include "sbx_ffi.h"
#include "syscalls.h"

int sbx_make_userns(const char *uid_map, const char *gid_map)
{
    return idmap_make_userns(uid_map, gid_map, 1);
}

/* A mount namespace where each of paths shows its files through the maps
 * of idmap_userns_fd (read-only where readonly[i]). */
int sbx_idmapped_mount_ns(const char *const *paths, const int *readonly, int n, int idmap_userns_fd)
{
    int fds[16] = {0}, rc = 0, made = 0;

    if (n > (int)(sizeof fds / sizeof fds[0]))
        return -E2BIG;
    for (; made < n; made++) {
        fds[made] = idmap_clone_tree(paths[made], readonly[made] ? MOUNT_ATTR_RDONLY : 0, idmap_userns_fd);
        if (fds[made] < 0) {
            rc = fds[made];
            break;
        }
    }
    if (rc == 0)
        rc = idmap_mount_ns(paths, fds, n);
    while (made > 0)
        close(fds[--made]);
    return rc;
}
