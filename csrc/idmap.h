/* Namespaces and idmapped trees a root host prepares before its guests run
 * as an unprivileged host user (idmap.c). All return -errno on failure. */
#ifndef SBX_IDMAP_H
#define SBX_IDMAP_H

#include <stdint.h>

/* A user namespace with these maps (uid_map/gid_map lines), owned by
 * owner_uid/gid (-1: by us); with forbid_nesting, it cannot create user
 * namespaces of its own. Returns its fd. The caller must be privileged over
 * the ids it maps. */
int idmap_make_userns(const char *uid_map, const char *gid_map, int forbid_nesting, int owner_uid, int owner_gid);

/* A detached clone of the tree at path, with mount attributes attrs, whose
 * ids appear through userns_fd's maps. Returns its fd. */
int idmap_clone_tree(const char *path, uint64_t attrs, int userns_fd);

/* A mount namespace, a copy of ours, with each detached tree tree_fds[i]
 * attached on targets[i] (existing files or directories). Returns its fd. */
int idmap_mount_ns(const char *const *targets, const int *tree_fds, int n);

#endif
