/* Guests of a root host run as an unprivileged host user.
 *
 * A root host cannot map a guest to another host uid from inside the new
 * user namespace (a process may map only its own uid there), and once it is
 * that uid, it can no longer reach the host paths only root may traverse,
 * nor make its workspace writable to itself. So, while still root, it:
 *   - makes user namespaces with the maps it wants, writing them from
 *     outside (idmap_make_userns);
 *   - clones the session's host trees, each made to show the workspace
 *     owner's files as the guest's through an idmapped mount
 *     (idmap_clone_tree): the guest writes them as itself, and on disk they
 *     stay the owner's;
 * and only then becomes the unprivileged user. The bwrap driver, whose bwrap
 * takes mounts by path only and resolves them as the guest's user, gets the
 * idmapped trees attached on paths that user can reach, in a mount
 * namespace bwrap then starts in (idmap_mount_ns).
 *
 * Used by the holder and, through the Python extension, by the bwrap
 * driver; everything returns -errno on failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idmap.h"
#include "syscalls.h"
#include "text_file.h"

static int write_child_file(pid_t child, const char *name, const char *data)
{
    char path[64];

    snprintf(path, sizeof path, "/proc/%d/%s", (int)child, name);
    return write_text_file(path, data, 0);
}

/* A helper child that enters a new namespace (what), tells us, waits for us
 * to set it up from outside, finishes inside (finish), and tells us again;
 * we keep a handle on the namespace (ns_name) and let it go. */
struct ns_helper {
    int flags;              /* unshare() flags */
    const char *ns_name;    /* file under /proc/PID/ns */
    int (*before)(void *arg);               /* run by the child first, or NULL */
    int (*outside)(pid_t child, void *arg); /* run by us between the steps */
    int (*inside)(void *arg);               /* run by the child at the end */
    void *arg;
};

static void child_step(int fd, int rc)
{
    while (write(fd, &rc, sizeof rc) < 0 && errno == EINTR)
        ;
}

static int parent_step(int fd)
{
    int rc;
    ssize_t n;

    while ((n = read(fd, &rc, sizeof rc)) < 0 && errno == EINTR)
        ;
    return n == (ssize_t)sizeof rc ? rc : -EPIPE;
}

static int make_namespace(const struct ns_helper *helper)
{
    int to_parent[2], to_child[2], rc, nsfd = -1;
    char path[64];
    pid_t child;

    if (pipe2(to_parent, O_CLOEXEC) < 0)
        return -errno;
    if (pipe2(to_child, O_CLOEXEC) < 0) {
        rc = -errno;
        close(to_parent[0]);
        close(to_parent[1]);
        return rc;
    }
    /* fork, not vfork: the child must outlive our next steps. It makes
     * only system calls, safe in a child of a threaded process. */
    child = fork();
    if (child == 0) {
        int go;

        close(to_parent[0]);
        close(to_child[1]); /* or the last step would wait for ourselves */
        go = helper->before ? helper->before(helper->arg) : 0;
        child_step(to_parent[1], go < 0 ? go : unshare(helper->flags) < 0 ? -errno : 0);
        go = parent_step(to_child[0]);
        child_step(to_parent[1], go < 0 ? go : helper->inside ? helper->inside(helper->arg) : 0);
        parent_step(to_child[0]); /* until our handle is taken */
        _exit(0);
    }
    close(to_parent[1]);
    close(to_child[0]);
    if (child < 0) {
        rc = -errno;
        goto out;
    }
    rc = parent_step(to_parent[0]);
    if (rc == 0 && helper->outside)
        rc = helper->outside(child, helper->arg);
    child_step(to_child[1], rc);
    if (rc == 0)
        rc = parent_step(to_parent[0]);
    if (rc == 0) {
        snprintf(path, sizeof path, "/proc/%d/ns/%s", (int)child, helper->ns_name);
        nsfd = open(path, O_RDONLY | O_CLOEXEC);
        rc = nsfd < 0 ? -errno : 0;
    }
    close(to_child[1]);
    to_child[1] = -1;
    waitpid(child, NULL, 0);
out:
    close(to_parent[0]);
    if (to_child[1] >= 0)
        close(to_child[1]);
    return rc < 0 ? rc : nsfd;
}

struct userns_maps {
    const char *uid_map, *gid_map;
    int forbid_nesting;
    int owner_uid, owner_gid; /* or -1 */
};

static int write_maps(pid_t child, void *arg)
{
    const struct userns_maps *maps = arg;
    int rc = write_child_file(child, "setgroups", "deny");

    if (rc == 0)
        rc = write_child_file(child, "uid_map", maps->uid_map);
    if (rc == 0)
        rc = write_child_file(child, "gid_map", maps->gid_map);
    return rc;
}

/* Inside, with every capability there: no namespace of this one may create
 * user namespaces (a guest there would get capabilities back). */
static int limit_nesting(void *arg)
{
    const struct userns_maps *maps = arg;

    return maps->forbid_nesting ? write_text_file("/proc/sys/user/max_user_namespaces", "0\n", 0) : 0;
}

/* Before unsharing: the namespace's owner is whoever makes it. */
static int become_owner(void *arg)
{
    const struct userns_maps *maps = arg;

    if (maps->owner_uid < 0)
        return 0;
    if (setgroups(0, NULL) < 0 || setresgid(maps->owner_gid, maps->owner_gid, maps->owner_gid) < 0 ||
        setresuid(maps->owner_uid, maps->owner_uid, maps->owner_uid) < 0)
        return -errno;
    return 0;
}

int idmap_make_userns(const char *uid_map, const char *gid_map, int forbid_nesting, int owner_uid, int owner_gid)
{
    struct userns_maps maps = {uid_map, gid_map, forbid_nesting, owner_uid, owner_gid};
    struct ns_helper helper = {CLONE_NEWUSER, "user", become_owner, write_maps, limit_nesting, &maps};

    return make_namespace(&helper);
}

int idmap_clone_tree(const char *path, uint64_t attrs, int userns_fd)
{
    int fd = sys_open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    int err;

    if (fd < 0)
        return -errno;
    if (sys_mount_idmap(fd, attrs, userns_fd) < 0) {
        err = errno;
        close(fd);
        return -err;
    }
    return fd;
}

struct attaching {
    const char *const *targets;
    const int *tree_fds;
    int n;
};

/* In the new mount namespace: each tree on its target. */
static int attach_trees(void *arg)
{
    const struct attaching *attaching = arg;

    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        return -errno;
    for (int i = 0; i < attaching->n; i++)
        if (sys_move_mount(attaching->tree_fds[i], "", AT_FDCWD, attaching->targets[i], MOVE_MOUNT_F_EMPTY_PATH) <
            0)
            return -errno;
    return 0;
}

int idmap_mount_ns(const char *const *targets, const int *tree_fds, int n)
{
    struct attaching attaching = {targets, tree_fds, n};
    struct ns_helper helper = {CLONE_NEWNS, "mnt", NULL, NULL, attach_trees, &attaching};

    return make_namespace(&helper);
}
