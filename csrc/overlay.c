/* The overlay workspace, mounted from file descriptors of its layers.
 *
 * A session made from a template (or a snapshot) sees /workspace as an
 * overlay: its own upper directory over read-only layers. Since Linux 6.13
 * overlayfs takes each layer as an fd (FSCONFIG_SET_FD), also of a detached
 * mount (open_tree(OPEN_TREE_CLONE), or a root host's idmapped clone), so
 * the layers need not be attached anywhere in the session's mount namespace.
 * The holder keeps those fds, the upper directory's, and the detached clone
 * of the directory that holds the upper and work directories (the "tree"),
 * for as long as it runs: a snapshot then asks it to restack, to mount a new
 * overlay over /workspace whose topmost read-only layer is the old upper
 * directory, with a new upper directory above, all without a new holder.
 * The host has renamed the old upper directory into the snapshot store
 * first (and the new one to its name); the holder's fd follows a directory
 * wherever it is renamed to on its file system.
 *
 * The holder is out of every guest's reach (non-dumpable, in no command's
 * pid namespace), each command's init closes these fds before anything of
 * the guest runs, and a command's mount namespace holds the overlay alone. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

void overlay_stack_init(struct overlay_stack *stack)
{
    stack->tree = -1;
    stack->upper = -1;
    stack->nlowers = 0;
    for (int i = 0; i < NSTORES; i++)
        stack->stores[i] = -1;
    stack->restackable = 0;
}

void overlay_stack_release(struct overlay_stack *stack)
{
    if (stack->tree >= 0)
        close(stack->tree);
    if (stack->upper >= 0)
        close(stack->upper);
    for (int i = 0; i < stack->nlowers; i++)
        close(stack->lowers[i]);
    for (int i = 0; i < NSTORES; i++)
        if (stack->stores[i] >= 0)
            close(stack->stores[i]);
    overlay_stack_init(stack);
}

/* An O_PATH fd of one directory directly in the directory dir. */
static int open_in(int dir, const char *name)
{
    if (!*name || strchr(name, '/') || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
        errno = EINVAL;
        return -1;
    }
    return openat(dir, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

/* What every workspace overlay is mounted with. In a user namespace
 * overlayfs keeps its metadata in user.* xattrs ("userxattr"). A snapshot
 * mounts a new overlay on the upper directory of one still mounted (which
 * no one writes through any more), and so does a fork: "index" (on by
 * default in some kernels' builds) would refuse that. */
int overlay_set_options(int fs)
{
    if (sys_fsconfig(fs, FSCONFIG_SET_FLAG, "userxattr", NULL, 0) < 0)
        return -1;
    return sys_fsconfig(fs, FSCONFIG_SET_STRING, "index", "off", 0);
}

static int overlay_mount_fds(const int *lowers, int nlowers, int upper, int work)
{
    int fs = sys_fsopen("overlay", FSOPEN_CLOEXEC), mnt, e;

    if (fs < 0)
        return -1;
    for (int i = 0; i < nlowers; i++)
        if (sys_fsconfig(fs, FSCONFIG_SET_FD, "lowerdir+", NULL, lowers[i]) < 0)
            goto failed;
    if (sys_fsconfig(fs, FSCONFIG_SET_FD, "upperdir", NULL, upper) < 0 ||
        sys_fsconfig(fs, FSCONFIG_SET_FD, "workdir", NULL, work) < 0 ||
        overlay_set_options(fs) < 0 ||
        sys_fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
        goto failed;
    mnt = sys_fsmount(fs, FSMOUNT_CLOEXEC, WORKSPACE_ATTRS);
    e = errno;
    close(fs);
    errno = e;
    return mnt;
failed:
    e = errno;
    close(fs);
    errno = e;
    return -1;
}

int overlay_mount_stack(struct overlay_stack *stack, const char *upper_name, const char *work_name)
{
    int upper = open_in(stack->tree, upper_name), work = open_in(stack->tree, work_name), mnt = -1, e;

    if (upper >= 0 && work >= 0)
        mnt = overlay_mount_fds(stack->lowers, stack->nlowers, upper, work);
    e = errno;
    if (mnt >= 0) {
        if (stack->upper >= 0)
            close(stack->upper);
        stack->upper = upper;
    } else if (upper >= 0) {
        close(upper);
    }
    if (work >= 0)
        close(work);
    errno = e;
    return mnt;
}

/* Replace the overlay at /workspace with the detached one mnt. No command
 * runs, and the next one's init is made after this: nothing but the host's
 * file handle (which the reply replaces) holds the old overlay, which goes
 * once that is closed. */
static int put_over_workspace(struct overlay_stack *stack, int mnt, int *workspace_fd, struct sbx_report *err)
{
    if (umount2("/workspace", MNT_DETACH) < 0 ||
        sys_move_mount(mnt, "", AT_FDCWD, "/workspace", MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        int e = errno;

        close(mnt);
        stack->restackable = 0; /* whatever /workspace is now, it is not to be trusted */
        return fail(err, "restack-swap", e, "cannot put the new overlay over /workspace: %s", strerror(e));
    }
    close(mnt);
    *workspace_fd = open("/workspace", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (*workspace_fd < 0)
        return fail(err, "restack-swap", errno, "cannot open the new /workspace: %s", strerror(errno));
    return 0;
}

int overlay_restack(struct overlay_stack *stack, const char *upper_name, const char *work_name, int *workspace_fd,
                    struct sbx_report *err)
{
    int pushed, mnt;

    if (!stack->restackable || stack->upper < 0)
        return fail(err, "restack", EOPNOTSUPP, "this session's workspace cannot take new layers in place");
    if (stack->nlowers == MAX_OVERLAY_LOWERS)
        return fail(err, "restack", E2BIG, "the workspace already stands on %d layers", MAX_OVERLAY_LOWERS);
    pushed = stack->upper;
    stack->upper = -1;
    memmove(stack->lowers + 1, stack->lowers, sizeof stack->lowers[0] * (size_t)stack->nlowers);
    stack->lowers[0] = pushed;
    stack->nlowers++;
    mnt = overlay_mount_stack(stack, upper_name, work_name);
    if (mnt < 0) {
        int e = errno;

        stack->nlowers--;
        memmove(stack->lowers, stack->lowers + 1, sizeof stack->lowers[0] * (size_t)stack->nlowers);
        stack->upper = pushed;
        return fail(err, "restack", e, "cannot mount the new overlay: %s", strerror(e));
    }
    return put_over_workspace(stack, mnt, workspace_fd, err);
}

int overlay_replace(struct overlay_stack *stack, const char *upper_name, const char *work_name,
                    const char *const *layers, int nlayers, int *workspace_fd, struct sbx_report *err)
{
    struct overlay_stack next = *stack;
    int mnt;

    if (!stack->restackable || stack->stores[STORE_TEMPLATES] < 0 || stack->stores[STORE_SNAPSHOTS] < 0)
        return fail(err, "restack", EOPNOTSUPP, "this session cannot take another workspace's layers");
    if (nlayers < 1 || nlayers > MAX_OVERLAY_LOWERS)
        return fail(err, "restack", EINVAL, "%d layers", nlayers);
    next.nlowers = 0;
    for (int i = 0; i < nlayers; i++) {
        const char *spec = layers[i];
        int store = spec[0] == 't' ? STORE_TEMPLATES : spec[0] == 's' ? STORE_SNAPSHOTS : -1, layer = -1;

        if (store >= 0 && spec[1] == '/') {
            int holder = open_in(stack->stores[store], spec + 2);

            if (holder >= 0) {
                layer = openat(holder, "files", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                close(holder);
            }
        }
        if (layer < 0) {
            int e = store < 0 ? EINVAL : errno;

            for (int j = 0; j < next.nlowers; j++)
                close(next.lowers[j]);
            return fail(err, "restack", e, "cannot open the layer %s: %s", spec, strerror(e));
        }
        next.lowers[next.nlowers++] = layer;
    }
    mnt = overlay_mount_stack(&next, upper_name, work_name);
    if (mnt < 0) {
        int e = errno;

        for (int j = 0; j < next.nlowers; j++)
            close(next.lowers[j]);
        return fail(err, "restack", e, "cannot mount the new overlay: %s", strerror(e));
    }
    for (int j = 0; j < stack->nlowers; j++)
        close(stack->lowers[j]);
    memcpy(stack->lowers, next.lowers, sizeof next.lowers[0] * (size_t)next.nlowers);
    stack->nlowers = next.nlowers;
    stack->upper = next.upper; /* the old one closed */
    return put_over_workspace(stack, mnt, workspace_fd, err);
}
