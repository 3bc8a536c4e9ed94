/* The session's namespaces and its user mapping. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "holder.h"

static int write_proc_file(const char *path, const char *data)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    ssize_t len = (ssize_t)strlen(data);

    if (fd < 0)
        return -errno;
    if (write(fd, data, (size_t)len) != len) {
        int err = errno;
        close(fd);
        return -err;
    }
    close(fd);
    return 0;
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
    rc = write_proc_file("/proc/self/setgroups", "deny");
    if (rc < 0)
        return fail(err, "setgroups", -rc, "cannot deny setgroups: %s", strerror(-rc));
    snprintf(map, sizeof map, "%u %u 1\n", cfg->inner_uid, cfg->outer_uid);
    rc = write_proc_file("/proc/self/uid_map", map);
    if (rc < 0)
        return fail(err, "uid_map", -rc, "cannot map uid %u to %u: %s", cfg->outer_uid,
                    cfg->inner_uid, strerror(-rc));
    snprintf(map, sizeof map, "%u %u 1\n", cfg->inner_gid, cfg->outer_gid);
    rc = write_proc_file("/proc/self/gid_map", map);
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
    int rc = write_proc_file("/proc/sys/user/max_user_namespaces", "0\n");

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
