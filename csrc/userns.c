/* The session's namespaces and its user mapping. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <grp.h>
#include <libgen.h>
#include <limits.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "holder.h"
#include "idmap.h"
#include "text_file.h"

/* Prepared fds must not sit on LEASE_FD, which the holder closes when it
 * is free of the launcher's business (it may be unused, so free here). */
static int keep_fd(int fd, int *out)
{
    *out = fcntl(fd, F_DUPFD_CLOEXEC, LEASE_FD + 1);
    if (*out < 0)
        *out = -errno;
    close(fd);
    return *out;
}

static int prepare_tree(const char *path, uint64_t attrs, int idmap, int *out, struct sbx_report *err)
{
    int fd = idmap_clone_tree(path, attrs, idmap);

    if (fd < 0 || keep_fd(fd, out) < 0)
        return fail(err, "idmap", fd < 0 ? -fd : -*out, "cannot clone %s with the guest's ids: %s", path,
                    strerror(fd < 0 ? -fd : -*out));
    return 0;
}

/* An image's files are its importer's: seen, like the workspace owner's, as
 * the guest's (as on a host that is not root, where both are the one user
 * sandboxns runs as). */
static int prepare_image_root(struct holder_config *cfg, const struct stat *workspace_owner, int idmap,
                              struct sbx_report *err)
{
    char uid_map[64], gid_map[64];
    struct stat owner;
    int rc;

    if (stat(cfg->image_root, &owner) < 0)
        return fail(err, "image", errno, "cannot stat %s: %s", cfg->image_root, strerror(errno));
    if (owner.st_uid == workspace_owner->st_uid && owner.st_gid == workspace_owner->st_gid)
        return prepare_tree(cfg->image_root, RUNTIME_RO, idmap, &cfg->prepared.image_root, err);
    snprintf(uid_map, sizeof uid_map, "%u %u 1\n", owner.st_uid, cfg->outer_uid);
    snprintf(gid_map, sizeof gid_map, "%u %u 1\n", owner.st_gid, cfg->outer_gid);
    idmap = idmap_make_userns(uid_map, gid_map, 0, -1, -1);
    if (idmap < 0)
        return fail(err, "idmap", -idmap, "cannot make the image's id mapping: %s", strerror(-idmap));
    rc = prepare_tree(cfg->image_root, RUNTIME_RO, idmap, &cfg->prepared.image_root, err);
    close(idmap);
    return rc;
}

/* A root host's part, before userns_enter (see idmap.c): clone every tree of
 * the session's own (workspace or overlay layers, extra binds, the gateway's
 * socket, an image's root filesystem, which sits in the state directory
 * like the workspace) so that the workspace owner's files appear as the guest's, then
 * become the unprivileged host user cfg->outer_uid/gid for good. The
 * overlay's upper and work directories must be siblings: both come from one
 * clone of their parent, as overlayfs wants them on one mount (rootfs.c
 * finds them there by name). */
int userns_prepare_host_ids(struct holder_config *cfg, struct sbx_report *err)
{
    struct prepared_trees *prepared = &cfg->prepared;
    char uid_map[64], gid_map[64], parent[PATH_MAX], work_parent[PATH_MAX];
    struct stat owner;
    int idmap, rc = -1;

    if (stat(cfg->workspace, &owner) < 0)
        return fail(err, "workspace", errno, "cannot stat %s: %s", cfg->workspace, strerror(errno));
    snprintf(uid_map, sizeof uid_map, "%u %u 1\n", owner.st_uid, cfg->outer_uid);
    snprintf(gid_map, sizeof gid_map, "%u %u 1\n", owner.st_gid, cfg->outer_gid);
    idmap = idmap_make_userns(uid_map, gid_map, 0, -1, -1);
    if (idmap < 0)
        return fail(err, "idmap", -idmap, "cannot make the id mapping: %s", strerror(-idmap));
    if (cfg->noverlay_lowers) {
        snprintf(parent, sizeof parent, "%s", cfg->workspace);
        snprintf(work_parent, sizeof work_parent, "%s", cfg->overlay_work);
        if (strcmp(dirname(parent), dirname(work_parent)) != 0) {
            fail(err, "idmap", EINVAL, "the overlay's upper and work directories must be siblings");
            goto out;
        }
        if (prepare_tree(parent, WORKSPACE_ATTRS, idmap, &prepared->overlay_tree, err) < 0)
            goto out;
        for (int i = 0; i < cfg->noverlay_lowers; i++)
            if (prepare_tree(cfg->overlay_lowers[i], RUNTIME_RO, idmap, &prepared->overlay_lowers[i], err) < 0)
                goto out;
        for (int i = 0; i < NSTORES; i++)
            if (cfg->stores[i] && prepare_tree(cfg->stores[i], RUNTIME_RO, idmap, &prepared->stores[i], err) < 0)
                goto out;
    } else if (prepare_tree(cfg->workspace, WORKSPACE_ATTRS, idmap, &prepared->workspace, err) < 0) {
        goto out;
    }
    for (int i = 0; i < cfg->nextra_binds; i++) {
        struct extra_bind *extra = &cfg->extra_binds[i];
        uint64_t attrs = extra->writable ? WORKSPACE_ATTRS : RUNTIME_RO | MOUNT_ATTR_NOEXEC;

        if (prepare_tree(extra->host, attrs, idmap, &extra->tree_fd, err) < 0)
            goto out;
    }
    if (cfg->gateway_dir &&
        prepare_tree(cfg->gateway_dir, RUNTIME_RO | MOUNT_ATTR_NOEXEC, idmap, &prepared->gateway_dir, err) < 0)
        goto out;
    if (cfg->image_root && prepare_image_root(cfg, &owner, idmap, err) < 0)
        goto out;
    /* Root's supplementary groups go first, while it may still drop them. */
    if (setgroups(0, NULL) < 0 || setresgid(cfg->outer_gid, cfg->outer_gid, cfg->outer_gid) < 0 ||
        setresuid(cfg->outer_uid, cfg->outer_uid, cfg->outer_uid) < 0) {
        fail(err, "host-ids", errno, "cannot become uid %u: %s", cfg->outer_uid, strerror(errno));
        goto out;
    }
    /* Changing uid made us non-dumpable, and /proc/self root's: userns_enter
     * writes our own maps there. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0) {
        fail(err, "host-ids", errno, "cannot reach our own /proc files: %s", strerror(errno));
        goto out;
    }
    rc = 0;
out:
    close(idmap);
    return rc;
}

/* unshare() every namespace the session needs and map the host user to the
 * configured inner user. The holder is single-threaded here, which
 * unshare(CLONE_NEWUSER) requires. The process keeps a full capability set in
 * the new user namespace (it created it) until each command drops it. */
int userns_enter(const struct holder_config *cfg, struct sbx_report *err)
{
    int flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
                CLONE_NEWCGROUP;
    char map[64];
    int rc;

    if (!cfg->share_network)
        flags |= CLONE_NEWNET;
    if (unshare(flags) < 0)
        return fail(err, "unshare", errno,
                    "cannot create namespaces: %s (are unprivileged user namespaces enabled?)",
                    strerror(errno));

    /* An unprivileged process may write a gid_map only after giving up
     * setgroups(2), so a guest can never drop a supplementary group that
     * denies it access to something on the host. */
    rc = write_text_file("/proc/self/setgroups", "deny", 0);
    if (rc < 0)
        return fail(err, "setgroups", -rc, "cannot deny setgroups: %s", strerror(-rc));
    snprintf(map, sizeof map, "%u %u 1\n", cfg->inner_uid, cfg->outer_uid);
    rc = write_text_file("/proc/self/uid_map", map, 0);
    if (rc < 0)
        return fail(err, "uid_map", -rc, "cannot map uid %u to %u: %s", cfg->outer_uid,
                    cfg->inner_uid, strerror(-rc));
    snprintf(map, sizeof map, "%u %u 1\n", cfg->inner_gid, cfg->outer_gid);
    rc = write_text_file("/proc/self/gid_map", map, 0);
    if (rc < 0)
        return fail(err, "gid_map", -rc, "cannot map gid %u to %u: %s", cfg->outer_gid,
                    cfg->inner_gid, strerror(-rc));
    return 0;
}

/* No guest may create a user namespace of its own: inside one it would hold
 * every capability again, and with it the kernel's whole namespaced attack
 * surface (the same as bwrap --disable-userns). The limit belongs to the
 * session's user namespace, where the holder has CAP_SYS_RESOURCE and guests,
 * having dropped every capability, cannot raise it again. */
int userns_forbid_nesting(struct sbx_report *err)
{
    int rc = write_text_file("/proc/sys/user/max_user_namespaces", "0\n", 0);

    if (rc < 0)
        return fail(err, "userns-limit", -rc, "cannot forbid nested user namespaces: %s", strerror(-rc));
    return 0;
}

/* Empty the holder's capability bounding set. It limits only what an execve
 * can grant, and the holder never execs, so the holder keeps the effective
 * capabilities it needs (mounting for each command's init); every process
 * it forks inherits the empty set. Doing it once here spares each command
 * some forty prctl calls. Needs CAP_SETPCAP, which the holder has in its
 * user namespace. */
int userns_empty_bounding_set(struct sbx_report *err)
{
    for (int cap = 0;; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL)
                return 0; /* past the kernel's last capability */
            return fail(err, "capabilities", errno, "cannot drop capability %d from the bounding set: %s", cap,
                        strerror(errno));
        }
    }
}
