/* The C boundary of the Python extension sandboxns._sbx: every function the
 * cffi module exposes, all prefixed sbx_ and returning -errno on failure. */
#ifndef SBX_FFI_H
#define SBX_FFI_H

#include "sbx_proto.h"

int sbx_spawn_holder(const char *path, char *const argv[], int control_fd, int lease_fd, int cgroup_procs_fd);
int sbx_openat2(int dirfd, const char *path, int flags, int mode, unsigned long long resolve);
int sbx_set_fs_ids(unsigned int uid, unsigned int gid);
int sbx_exchange(const char *a, const char *b);
int sbx_make_userns(const char *uid_map, const char *gid_map, int owner_uid, int owner_gid);
int sbx_idmapped_mount_ns(const char *const *sources, const char *const *targets, const int *readonly, int n,
                              const int *idmap_userns_fds);
int sbx_image_mount(const char *image, const char *target);
int sbx_image_unmount(const char *target);

#endif
