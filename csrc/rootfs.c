/* The session's root filesystem.
 *
 * The host's trees are cloned with open_tree(OPEN_TREE_CLONE) *before*
 * anything is mounted over them, so a workspace that lives under the path we
 * later cover (NEW_ROOT) is still bound correctly. Each clone is made
 * read-only with mount_setattr(AT_RECURSIVE): unlike a classic bind +
 * remount, that also covers any mount nested under /usr, and the guest cannot
 * undo it because every command drops its capabilities before exec. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"
#include "text_file.h"

/* Any existing directory works as the build location: what was under it has
 * already been cloned, and the mount is private to the session. */
#define NEW_ROOT "/tmp"
#define MAX_BINDS (16 + MAX_EXTRA_BINDS)

struct bind {
    char target[PATH_MAX]; /* relative to the new root */
    int fd;          /* detached clone from open_tree */
    uint64_t attrs;
    int is_dir;
};

struct plan {
    struct bind binds[MAX_BINDS];
    int nbinds;
    char symlinks[6][2][PATH_MAX]; /* runtime dirs the host has as symlinks, the gateway's socket */
    int nsymlinks;
    char resolv_conf[4096];
    int image_root;       /* the image's tree (a detached mount), with cfg->image_root */
    int image_root_owned; /* ours to close (not a root host's prepared clone) */
};

static const char *const runtime_dirs[] = {"usr", "bin", "sbin", "lib", "lib64"};
static const char *const device_nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};

/* Clone source to be bound at target with attrs, or take the clone a root
 * host prepared (prepared >= 0, attributes already set; see idmap.c). */
static int clone_tree(struct plan *plan, const char *source, const char *target, uint64_t attrs, int prepared,
                      struct sbx_report *err)
{
    struct bind *bind = &plan->binds[plan->nbinds];
    struct stat st;
    int fd = prepared;

    if (plan->nbinds == MAX_BINDS)
        return fail(err, "bind", E2BIG, "too many bind mounts");
    if (fd < 0)
        fd = sys_open_tree(AT_FDCWD, source, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (fd < 0)
        return fail(err, "bind", errno, "cannot clone %s: %s", source, strerror(errno));
    if (fstat(fd, &st) < 0) {
        close(fd);
        return fail(err, "bind", errno, "cannot stat %s: %s", source, strerror(errno));
    }
    if (prepared < 0 && sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, attrs) < 0) {
        close(fd);
        return fail(err, "bind", errno, "cannot restrict %s: %s", source, strerror(errno));
    }
    snprintf(bind->target, sizeof bind->target, "%s", target);
    bind->fd = fd;
    bind->attrs = attrs;
    bind->is_dir = S_ISDIR(st.st_mode);
    plan->nbinds++;
    return 0;
}

/* The lower layers as older kernels' "lowerdir" takes them: one string,
 * topmost first, separated by ':', with '\\' and ':' in a path escaped. */
static int join_lowers(char *out, size_t size, const char *const *lowers, int nlowers)
{
    size_t at = 0;

    for (int i = 0; i < nlowers; i++) {
        for (const char *c = lowers[i]; *c; c++) {
            if ((*c == ':' || *c == '\\') && at + 1 < size)
                out[at++] = '\\';
            if (at + 1 < size)
                out[at++] = *c;
        }
        if (i + 1 < nlowers && at + 1 < size)
            out[at++] = ':';
    }
    if (at + 1 >= size) {
        errno = ENAMETOOLONG;
        return -1;
    }
    out[at] = '\0';
    return 0;
}

/* "lowerdir+" (Linux 6.8) takes one path verbatim, topmost first; older
 * kernels parse "lowerdir" as a list. */
static int set_lowers(int fs, const char *const *lowers, int nlowers)
{
    static char joined[MAX_OVERLAY_LOWERS * PATH_MAX];
    int appended = 0;

    while (appended < nlowers && sys_fsconfig(fs, FSCONFIG_SET_STRING, "lowerdir+", lowers[appended], 0) == 0)
        appended++;
    if (appended == 0)
        return join_lowers(joined, sizeof joined, lowers, nlowers) < 0 ||
                       sys_fsconfig(fs, FSCONFIG_SET_STRING, "lowerdir", joined, 0) < 0
                   ? -1
                   : 0;
    return appended < nlowers ? -1 : 0;
}

static int set_layers(int fs, const char *const *lowers, int nlowers, const char *upper, const char *work)
{
    if (set_lowers(fs, lowers, nlowers) < 0 ||
        sys_fsconfig(fs, FSCONFIG_SET_STRING, "upperdir", upper, 0) < 0 ||
        sys_fsconfig(fs, FSCONFIG_SET_STRING, "workdir", work, 0) < 0)
        return -1;
    return 0;
}

/* overlayfs takes private clones of its layers' mounts, which it cannot make
 * of detached trees: a root host's prepared layers (see userns.c) are
 * attached for the moment on a scratch tmpfs, at NEW_ROOT, which is
 * detached again once the overlay exists (and mounted afresh later to
 * become the root). Nothing else is looked up under NEW_ROOT in between:
 * on a root host every tree of the session's own was prepared. */
#define LAYERS NEW_ROOT "/.layers"

static void prepared_lower_path(char *out, size_t size, int index)
{
    snprintf(out, size, LAYERS "/lower%d", index);
}

static void prepared_store_path(char *out, size_t size, int index)
{
    snprintf(out, size, LAYERS "/store%d", index);
}

static int attach_prepared_layers(const struct holder_config *cfg, struct sbx_report *err)
{
    char lower[PATH_MAX];

    if (mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700") < 0 ||
        mkdir(LAYERS, 0700) < 0 || mkdir(LAYERS "/upper", 0700) < 0)
        return fail(err, "overlay", errno, "cannot make room for the overlay's layers: %s", strerror(errno));
    if (sys_move_mount(cfg->prepared.overlay_tree, "", AT_FDCWD, LAYERS "/upper", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        return fail(err, "overlay", errno, "cannot attach the overlay's upper layer: %s", strerror(errno));
    for (int i = 0; i < cfg->noverlay_lowers; i++) {
        prepared_lower_path(lower, sizeof lower, i);
        if (mkdir(lower, 0700) < 0 ||
            sys_move_mount(cfg->prepared.overlay_lowers[i], "", AT_FDCWD, lower, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            return fail(err, "overlay", errno, "cannot attach the overlay's layer %s: %s", cfg->overlay_lowers[i],
                        strerror(errno));
    }
    for (int i = 0; i < NSTORES; i++) {
        if (cfg->prepared.stores[i] < 0)
            continue;
        prepared_store_path(lower, sizeof lower, i);
        if (mkdir(lower, 0700) < 0 ||
            sys_move_mount(cfg->prepared.stores[i], "", AT_FDCWD, lower, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            return fail(err, "overlay", errno, "cannot attach the layer store %s: %s", cfg->stores[i],
                        strerror(errno));
    }
    return 0;
}

static void layer_path(char *out, size_t size, const char *sibling)
{
    char copy[PATH_MAX];

    snprintf(copy, sizeof copy, "%s", sibling);
    snprintf(out, size, LAYERS "/upper/%s", basename(copy));
}

/* The workspace's layers as fds for the holder to keep (see overlay.c):
 * clones, made in the session's own mount namespace (overlayfs takes a
 * detached layer only from a mount namespace its user namespace owns), of
 * the directory of the upper and work directories and of each lower layer,
 * at the paths where they are now: the host's, or a root host's prepared
 * trees where attach_prepared_layers put them. */
static int stack_layers(struct overlay_stack *stack, const char *tree, const char *const *lowers, int nlowers,
                        const char *const *stores)
{
    stack->tree = sys_open_tree(AT_FDCWD, tree, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    for (int i = 0; i < nlowers; i++)
        stack->lowers[stack->nlowers++] = sys_open_tree(AT_FDCWD, lowers[i], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (stack->tree < 0)
        return -1;
    for (int i = 0; i < stack->nlowers; i++)
        if (stack->lowers[i] < 0)
            return -1;
    for (int i = 0; i < NSTORES; i++)
        if (stores[i] && (stack->stores[i] = sys_open_tree(AT_FDCWD, stores[i], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)) < 0)
            return -1;
    return 0;
}

/* The overlay from the layers' fds, which the holder keeps to restack it
 * later; -1 (and an empty stack) where the kernel takes no layer by fd, or
 * the fds cannot be had: then the caller mounts it by path. */
static int overlay_by_fds(const struct holder_config *cfg, struct overlay_stack *stack, const char *upper,
                          const char *work, const char *const *lowers, const char *const *stores)
{
    char tree[PATH_MAX], work_parent[PATH_MAX], upper_name[PATH_MAX], work_name[PATH_MAX];
    int mnt;

    snprintf(tree, sizeof tree, "%s", upper);
    snprintf(work_parent, sizeof work_parent, "%s", work);
    snprintf(upper_name, sizeof upper_name, "%s", upper);
    snprintf(work_name, sizeof work_name, "%s", work);
    /* Their parent is the stack's tree: they must be siblings. */
    if (strcmp(dirname(tree), dirname(work_parent)) != 0 ||
        stack_layers(stack, tree, lowers, cfg->noverlay_lowers, stores) < 0 ||
        (mnt = overlay_mount_stack(stack, basename(upper_name), basename(work_name))) < 0) {
        overlay_stack_release(stack);
        return -1;
    }
    /* A new overlay over /workspace would leave behind what is mounted inside it. */
    stack->restackable = 1;
    for (int i = 0; i < cfg->nextra_binds; i++)
        if (strncmp(cfg->extra_binds[i].guest, "/workspace/", strlen("/workspace/")) == 0)
            stack->restackable = 0;
    return mnt;
}

/* A session made from a template sees the template's files as the lower
 * layer of an overlay whose upper layer is the session's own directory, so
 * creating a session costs the same for ten files or ten thousand; above the
 * template, the snapshots its workspace was forked from (mounted with
 * overlay_set_options). A failure here is reported as step "overlay", and
 * the host falls back to a copied workspace. */
static int overlay_workspace(const struct holder_config *cfg, struct plan *plan, struct overlay_stack *stack,
                             struct sbx_report *err)
{
    struct bind *bind = &plan->binds[plan->nbinds];
    const char *const *lowers = cfg->overlay_lowers, *upper = cfg->workspace, *work = cfg->overlay_work;
    const char *stores[NSTORES] = {cfg->stores[0], cfg->stores[1]};
    static char prepared_lowers[MAX_OVERLAY_LOWERS][PATH_MAX], prepared_stores[NSTORES][PATH_MAX];
    const char *prepared_lower_list[MAX_OVERLAY_LOWERS];
    char prepared_upper[PATH_MAX], prepared_work[PATH_MAX];
    int prepared = cfg->prepared.overlay_tree >= 0, fs, mnt;

    if (plan->nbinds == MAX_BINDS)
        return fail(err, "bind", E2BIG, "too many bind mounts");
    if (prepared) {
        if (attach_prepared_layers(cfg, err) < 0)
            return -1;
        layer_path(prepared_upper, sizeof prepared_upper, cfg->workspace);
        layer_path(prepared_work, sizeof prepared_work, cfg->overlay_work);
        for (int i = 0; i < cfg->noverlay_lowers; i++) {
            prepared_lower_path(prepared_lowers[i], PATH_MAX, i);
            prepared_lower_list[i] = prepared_lowers[i];
        }
        lowers = prepared_lower_list;
        upper = prepared_upper;
        work = prepared_work;
        for (int i = 0; i < NSTORES; i++) {
            if (!stores[i])
                continue;
            prepared_store_path(prepared_stores[i], PATH_MAX, i);
            stores[i] = prepared_stores[i];
        }
    }
    mnt = overlay_by_fds(cfg, stack, upper, work, lowers, stores);
    if (mnt < 0) {
        fs = sys_fsopen("overlay", FSOPEN_CLOEXEC);
        if (fs < 0)
            return fail(err, "overlay", errno, "cannot create an overlay: %s", strerror(errno));
        if (set_layers(fs, lowers, cfg->noverlay_lowers, upper, work) < 0 ||
            overlay_set_options(fs) < 0 ||
            sys_fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) {
            int e = errno;
            close(fs);
            return fail(err, "overlay", e, "cannot set up the overlay over %s (and %d layers below): %s",
                        cfg->overlay_lowers[0], cfg->noverlay_lowers - 1, strerror(e));
        }
        mnt = sys_fsmount(fs, FSMOUNT_CLOEXEC, WORKSPACE_ATTRS);
        close(fs);
    }
    if (prepared && umount2(NEW_ROOT, MNT_DETACH) < 0) {
        int e = errno;
        if (mnt >= 0)
            close(mnt);
        return fail(err, "overlay", e, "cannot put the overlay's layers away: %s", strerror(e));
    }
    if (mnt < 0)
        return fail(err, "overlay", errno, "cannot mount the overlay: %s", strerror(errno));
    snprintf(bind->target, sizeof bind->target, "workspace");
    bind->fd = mnt;
    bind->attrs = WORKSPACE_ATTRS;
    bind->is_dir = 1;
    plan->nbinds++;
    return 0;
}

static int is_directory(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int read_small_file(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n;

    buf[0] = '\0';
    if (fd < 0)
        return -errno;
    n = read(fd, buf, size - 1);
    close(fd);
    if (n < 0)
        return -errno;
    buf[n] = '\0';
    return 0;
}

/* The host's runtime trees, for a guest whose root is the host's. */
static int collect_runtime_trees(struct plan *plan, struct sbx_report *err)
{
    char path[PATH_MAX];

    for (size_t i = 0; i < sizeof runtime_dirs / sizeof runtime_dirs[0]; i++) {
        struct stat st;

        snprintf(path, sizeof path, "/%s", runtime_dirs[i]);
        if (lstat(path, &st) < 0)
            continue; /* the host does not have it, so neither does the guest */
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlink(path, plan->symlinks[plan->nsymlinks][1], PATH_MAX - 1);
            if (n < 0)
                return fail(err, "runtime", errno, "cannot read link %s: %s", path,
                            strerror(errno));
            plan->symlinks[plan->nsymlinks][1][n] = '\0';
            snprintf(plan->symlinks[plan->nsymlinks][0], PATH_MAX, "%s", runtime_dirs[i]);
            plan->nsymlinks++;
        } else if (S_ISDIR(st.st_mode) && clone_tree(plan, path, runtime_dirs[i], RUNTIME_RO, -1, err) < 0) {
            return -1;
        }
    }
    if (is_directory("/etc/alternatives") &&
        clone_tree(plan, "/etc/alternatives", "etc/alternatives", RUNTIME_RO, -1, err) < 0)
        return -1;
    if (is_directory("/etc/ssl/certs") &&
        clone_tree(plan, "/etc/ssl/certs", "etc/ssl/certs", RUNTIME_RO, -1, err) < 0)
        return -1;
    /* Not needed for correctness, but without it the dynamic linker probes
     * a dozen directories on every exec. */
    if (access("/etc/ld.so.cache", R_OK) == 0 &&
        clone_tree(plan, "/etc/ld.so.cache", "etc/ld.so.cache", RUNTIME_RO, -1, err) < 0)
        return -1;
    return 0;
}

/* An image's root filesystem (see mount_image_root), cloned read-only, or
 * the clone a root host prepared. */
static int collect_image_root(const struct holder_config *cfg, struct plan *plan, struct sbx_report *err)
{
    int fd = cfg->prepared.image_root;

    if (fd < 0) {
        fd = sys_open_tree(AT_FDCWD, cfg->image_root, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
        if (fd < 0)
            return fail(err, "image", errno, "cannot clone the image root %s: %s", cfg->image_root, strerror(errno));
        if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, RUNTIME_RO) < 0) {
            int e = errno;
            close(fd);
            return fail(err, "image", e, "cannot restrict the image root %s: %s", cfg->image_root, strerror(e));
        }
        plan->image_root_owned = 1;
    }
    plan->image_root = fd;
    return 0;
}

/* Everything the root needs from the host, gathered while the host's
 * filesystem is still visible. */
static int collect_host_trees(const struct holder_config *cfg, struct plan *plan, struct overlay_stack *stack,
                              struct sbx_report *err)
{
    char path[PATH_MAX];

    if (cfg->image_root ? collect_image_root(cfg, plan, err) < 0 : collect_runtime_trees(plan, err) < 0)
        return -1;
    if (cfg->prepared.workspace < 0 && cfg->prepared.overlay_tree < 0 && !is_directory(cfg->workspace))
        return fail(err, "workspace", ENOTDIR, "workspace %s is not a directory", cfg->workspace);
    if (cfg->noverlay_lowers ? overlay_workspace(cfg, plan, stack, err) < 0
                           : clone_tree(plan, cfg->workspace, "workspace", WORKSPACE_ATTRS, cfg->prepared.workspace,
                                        err) < 0)
        return -1;
    /* Extra trees after the workspace, so one may cover a path inside it. */
    for (int i = 0; i < cfg->nextra_binds; i++) {
        const struct extra_bind *extra = &cfg->extra_binds[i];

        if (clone_tree(plan, extra->host, extra->guest + 1,
                       extra->writable ? WORKSPACE_ATTRS : RUNTIME_RO | MOUNT_ATTR_NOEXEC, extra->tree_fd, err) < 0)
            return -1;
    }
    /* The egress gateway's directory: its socket (connecting to a socket
     * needs no write access to its mount, so it is bound read-only like
     * everything else), and what the host adds while the session runs (the
     * session CA's trust bundle). The socket's own path links into it. */
    if (cfg->gateway_dir) {
        if (clone_tree(plan, cfg->gateway_dir, "run/sandboxns", RUNTIME_RO | MOUNT_ATTR_NOEXEC,
                       cfg->prepared.gateway_dir, err) < 0)
            return -1;
        snprintf(plan->symlinks[plan->nsymlinks][0], PATH_MAX, "run/sandboxns-network.sock");
        snprintf(plan->symlinks[plan->nsymlinks][1], PATH_MAX, "sandboxns/network.sock");
        plan->nsymlinks++;
    }
    for (size_t i = 0; i < sizeof device_nodes / sizeof device_nodes[0]; i++) {
        char target[32];

        snprintf(path, sizeof path, "/dev/%s", device_nodes[i]);
        snprintf(target, sizeof target, "dev/%s", device_nodes[i]);
        if (clone_tree(plan, path, target, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, -1, err) < 0)
            return -1;
    }
    /* With the host's network shared, its resolver configuration is the one
     * that works; otherwise there is no DNS to configure. */
    if (cfg->share_network)
        read_small_file("/etc/resolv.conf", plan->resolv_conf, sizeof plan->resolv_conf);
    return 0;
}

static int make_dir(const char *path, struct sbx_report *err)
{
    if (mkdir(path, 0755) < 0 && errno != EEXIST)
        return fail(err, "mkdir", errno, "cannot create /%s: %s", path, strerror(errno));
    return 0;
}

static int write_etc_file(const char *path, const char *content, struct sbx_report *err)
{
    int rc = write_text_file(path, content, O_CREAT | O_TRUNC);

    if (rc < 0)
        return fail(err, "etc", -rc, "cannot write /%s: %s", path, strerror(-rc));
    return 0;
}

/* Open, creating it if missing, the mount point of bind inside the new root
 * (our cwd): one component at a time, never following a symlink. An extra
 * bind's target may lie under an earlier bind of a host tree a guest could
 * write (the workspace, between sessions), and a symlink planted there must
 * not lead the holder's mkdir, open or mount anywhere else on the host. */
static int open_mount_point(const struct bind *bind, struct sbx_report *err)
{
    char path[PATH_MAX];
    char *component = path, *next;
    int dirfd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);

    if (dirfd < 0)
        return fail(err, "bind", errno, "cannot open the new root: %s", strerror(errno));
    snprintf(path, sizeof path, "%s", bind->target);
    for (;;) {
        struct stat st;
        int fd, last;

        next = strchr(component, '/');
        last = next == NULL;
        if (next)
            *next = '\0';
        if (!last || bind->is_dir) {
            if (mkdirat(dirfd, component, 0755) < 0 && errno != EEXIST) {
                int e = errno;
                close(dirfd);
                return fail(err, "bind", e, "cannot create /%s: %s", bind->target, strerror(e));
            }
            fd = openat(dirfd, component, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        } else {
            fd = openat(dirfd, component, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
            if (fd >= 0)
                close(fd);
            fd = openat(dirfd, component, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) {
                close(fd);
                fd = -1;
                errno = ELOOP; /* a symlink (or something odd) where the file goes */
            }
        }
        close(dirfd);
        if (fd < 0)
            return fail(err, "bind", errno, "cannot open the mount point /%s: %s", bind->target,
                        strerror(errno));
        if (last)
            return fd;
        dirfd = fd;
        component = next + 1;
    }
}

static int attach_bind(const struct bind *bind, struct sbx_report *err)
{
    int target = open_mount_point(bind, err);

    if (target < 0)
        return -1;
    if (sys_move_mount(bind->fd, "", target, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0) {
        int e = errno;
        close(target);
        return fail(err, "bind", e, "cannot mount /%s: %s", bind->target, strerror(e));
    }
    close(target);
    return 0;
}

static int mount_fs(const char *fstype, const char *target, unsigned long flags, const char *options,
                    struct sbx_report *err)
{
    if (mount(fstype, target, fstype, flags, options) < 0)
        return fail(err, "mount", errno, "cannot mount %s on /%s: %s", fstype, target,
                    strerror(errno));
    return 0;
}

static int write_etc(const struct holder_config *cfg, const struct plan *plan,
                     struct sbx_report *err)
{
    char passwd[256], group[256], hosts[256];

    if (cfg->inner_uid == 0) {
        snprintf(passwd, sizeof passwd, "root:x:0:%u:root:/workspace:/bin/sh\n", cfg->inner_gid);
    } else {
        snprintf(passwd, sizeof passwd,
                 "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                 "sandbox:x:%u:%u:sandbox:/workspace:/bin/sh\n",
                 cfg->inner_uid, cfg->inner_gid);
    }
    if (cfg->inner_gid == 0)
        snprintf(group, sizeof group, "root:x:0:\n");
    else
        snprintf(group, sizeof group, "root:x:0:\nsandbox:x:%u:\n", cfg->inner_gid);
    snprintf(hosts, sizeof hosts, "127.0.0.1\tlocalhost %s\n::1\tlocalhost ip6-localhost\n",
             cfg->hostname);
    if (write_etc_file("etc/passwd", passwd, err) < 0 || write_etc_file("etc/group", group, err) < 0 ||
        write_etc_file("etc/hosts", hosts, err) < 0 ||
        write_etc_file("etc/hostname", cfg->hostname, err) < 0 ||
        write_etc_file("etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n", err) < 0)
        return -1;
    if (plan->resolv_conf[0] && write_etc_file("etc/resolv.conf", plan->resolv_conf, err) < 0)
        return -1;
    return 0;
}

static int build_dev(struct sbx_report *err)
{
    static const char *const links[][2] = {
        {"pts/ptmx", "dev/ptmx"},       {"/proc/self/fd", "dev/fd"},
        {"/proc/self/fd/0", "dev/stdin"}, {"/proc/self/fd/1", "dev/stdout"},
        {"/proc/self/fd/2", "dev/stderr"}, {"/proc/kcore", "dev/core"},
    };

    if (mount_fs("tmpfs", "dev", MS_NOSUID | MS_NOEXEC, "mode=0755", err) < 0 ||
        make_dir("dev/pts", err) < 0 || make_dir("dev/shm", err) < 0 ||
        mount_fs("devpts", "dev/pts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620",
                 err) < 0)
        return -1;
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (symlink(links[i][0], links[i][1]) < 0)
            return fail(err, "dev", errno, "cannot link /%s: %s", links[i][1], strerror(errno));
    return 0;
}

static int enter_new_root(struct sbx_report *err)
{
    /* pivot_root(".", ".") stacks the old root on top of the new one; a lazy
     * unmount of "." then drops it, and nothing of the host's tree remains
     * reachable. */
    if (sys_pivot_root(".", ".") < 0)
        return fail(err, "pivot_root", errno, "cannot pivot into the new root: %s", strerror(errno));
    if (umount2(".", MNT_DETACH) < 0)
        return fail(err, "pivot_root", errno, "cannot detach the host root: %s", strerror(errno));
    if (chdir("/") < 0)
        return fail(err, "pivot_root", errno, "cannot enter the new root: %s", strerror(errno));
    /* Only /workspace (and each command's own /tmp and /dev/shm) is writable. */
    if (sys_mount_setattr(AT_FDCWD, "/", 0, MOUNT_ATTR_RDONLY) < 0 ||
        sys_mount_setattr(AT_FDCWD, "/dev", 0, MOUNT_ATTR_RDONLY) < 0)
        return fail(err, "readonly", errno, "cannot make the root read-only: %s", strerror(errno));
    return 0;
}

/* With an image, the guest's root is a read-only overlay of two layers and
 * no upper one: on top, a skeleton on the scratch tmpfs holding what the
 * session adds (its mount points, the synthesized /etc files, the
 * gateway's link), and below it the image's tree. Nothing is copied, so a
 * session starts as fast on a large image as on a small one, and nothing
 * can write the image. A directory of the skeleton merges with the
 * image's; a file or link of the skeleton hides the image's. Both layers
 * are attached under NEW_ROOT, which the overlay then covers, and the
 * holder never follows a link of the image's (see open_mount_point). */
#define SKELETON NEW_ROOT "/.skeleton"
#define IMAGE_LOWER NEW_ROOT "/.image"

static int attach_image_root(struct plan *plan, struct sbx_report *err)
{
    int rc = 0;

    if (mkdir(SKELETON, 0755) < 0 || mkdir(IMAGE_LOWER, 0755) < 0)
        rc = fail(err, "image", errno, "cannot make room for the image: %s", strerror(errno));
    else if (sys_move_mount(plan->image_root, "", AT_FDCWD, IMAGE_LOWER, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        rc = fail(err, "image", errno, "cannot attach the image's tree: %s", strerror(errno));
    if (plan->image_root_owned)
        close(plan->image_root);
    return rc;
}

/* The skeleton's mount points, made before the overlay over it is
 * read-only (attach_bind then finds them there). */
static int make_mount_points(const struct plan *plan, struct sbx_report *err)
{
    for (int i = 0; i < plan->nbinds; i++) {
        int fd = open_mount_point(&plan->binds[i], err);

        if (fd < 0)
            return -1;
        close(fd);
    }
    return 0;
}

static int mount_image_root(struct sbx_report *err)
{
    static const char *const lowers[] = {SKELETON, IMAGE_LOWER};
    int fs = sys_fsopen("overlay", FSOPEN_CLOEXEC), mnt, e;

    if (fs < 0)
        return fail(err, "image", errno, "cannot create an overlay for the image: %s", strerror(errno));
    if (set_lowers(fs, lowers, 2) < 0 || overlay_set_options(fs) < 0 ||
        sys_fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) {
        e = errno;
        close(fs);
        return fail(err, "image", e, "cannot set up the overlay of the image: %s", strerror(e));
    }
    mnt = sys_fsmount(fs, FSMOUNT_CLOEXEC, RUNTIME_RO);
    e = errno;
    close(fs);
    if (mnt < 0)
        return fail(err, "image", e, "cannot mount the overlay of the image: %s", strerror(e));
    if (sys_move_mount(mnt, "", AT_FDCWD, NEW_ROOT, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        e = errno;
        close(mnt);
        return fail(err, "image", e, "cannot attach the overlay of the image: %s", strerror(e));
    }
    close(mnt);
    if (chdir(NEW_ROOT) < 0)
        return fail(err, "chdir", errno, "cannot enter the new root: %s", strerror(errno));
    return 0;
}

int rootfs_build(const struct holder_config *cfg, struct overlay_stack *stack, struct sbx_report *err)
{
    static struct plan plan;

    /* Nothing we mount may propagate back to the host's namespace. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        return fail(err, "mount-private", errno, "cannot make mounts private: %s", strerror(errno));
    if (collect_host_trees(cfg, &plan, stack, err) < 0)
        return -1;
    if (mount_fs("tmpfs", NEW_ROOT, MS_NOSUID | MS_NODEV, "mode=0755", err) < 0)
        return -1;
    if (cfg->image_root && attach_image_root(&plan, err) < 0)
        return -1;
    if (chdir(cfg->image_root ? SKELETON : NEW_ROOT) < 0)
        return fail(err, "chdir", errno, "cannot enter the new root: %s", strerror(errno));
    if (make_dir("etc", err) < 0 || make_dir("proc", err) < 0 || make_dir("tmp", err) < 0 ||
        make_dir("run", err) < 0 || make_dir("dev", err) < 0)
        return -1;
    for (int i = 0; i < plan.nsymlinks; i++)
        if (symlink(plan.symlinks[i][1], plan.symlinks[i][0]) < 0)
            return fail(err, "runtime", errno, "cannot link /%s: %s", plan.symlinks[i][0],
                        strerror(errno));
    if (write_etc(cfg, &plan, err) < 0)
        return -1;
    if (cfg->image_root && (make_mount_points(&plan, err) < 0 || mount_image_root(err) < 0))
        return -1;
    if (build_dev(err) < 0)
        return -1;
    for (int i = 0; i < plan.nbinds; i++) {
        if (attach_bind(&plan.binds[i], err) < 0)
            return -1;
        close(plan.binds[i].fd);
    }
    /* The holder is pid 1 of the session's pid namespace, so this proc shows
     * only the session; each command mounts its own over it. The kernel lets
     * a user namespace mount proc only where a fully visible proc already
     * exists in the mount namespace: this one is what makes the per-command
     * mounts possible after the host's tree is gone. */
    if (mount_fs("proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL, err) < 0)
        return -1;
    return enter_new_root(err);
}
