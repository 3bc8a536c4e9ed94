/* Commands: a per-command init in fresh mount, pid and IPC namespaces, and
 * the command itself under it.
 *
 *   holder --clone3(NEWNS|NEWPID|NEWIPC)--> init (pid 1) --fork--> command (pid 2)
 *
 * The holder prepares an init before any request arrives: creating the
 * namespaces and mounting an empty /tmp, /dev/shm and the init's own /proc
 * is most of a command's setup cost, and this takes it off the request's
 * path. The init waits on its own socket for a request (the same message the
 * host sent, with the same fds), forks the command, forwards termination
 * signals to it, and when it exits kills and reaps every other process in
 * the namespace (including ones that setsid() or double-forked away) before
 * reporting the exit status. So when the host sees EXITED, the command's
 * whole tree is gone.
 *
 * Then, rather than exit (and have the kernel tear the namespaces down, and
 * the holder make new ones for the next command), the init puts them back
 * as a new one finds them and waits for another request: an empty /tmp and
 * /dev/shm as mounted (emptied, their mode, owner, times and extended
 * attributes restored, unless provably untouched), no SysV IPC object and
 * no POSIX message queue left, and the next pid 2. Nothing else of a
 * command outlives it: its processes are gone, it could not mount (no
 * capabilities, and the command part of the seccomp filter, which the init
 * installs once and the command inherits), and the rest of its root is
 * read-only. None of this takes a mount call, which the init's own filter
 * denies from then on. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/mount.h>
#include <sys/msg.h>
#include <sys/prctl.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

/* fd on which the command reports a failed setup step; close-on-exec, so a
 * successful execve closes it. */
#define COMMAND_REPORT_FD 3
#define DEFAULT_PATH "/usr/local/bin:/usr/bin:/bin"

static volatile sig_atomic_t command_pid;

static void forward_signal(int sig)
{
    if (command_pid > 0)
        kill(command_pid, sig);
}

static int drop_capabilities(struct sbx_report *err)
{
    struct __user_cap_header_struct header = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    /* The bounding set is already empty: the holder emptied its own once
     * (userns_empty_bounding_set), and every init and command inherits it,
     * so even a uid-0 guest gains nothing on execve. */
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return fail(err, "capabilities", errno, "cannot clear ambient capabilities: %s",
                    strerror(errno));
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0)
        return fail(err, "capabilities", errno, "cannot clear capabilities: %s", strerror(errno));
    return 0;
}

static const char *env_lookup(char **envp, const char *name)
{
    size_t len = strlen(name);

    for (; *envp; envp++)
        if (strncmp(*envp, name, len) == 0 && (*envp)[len] == '=')
            return *envp + len + 1;
    return NULL;
}

/* execve, searching the guest's PATH (from the guest's environment, not the
 * holder's) for a name without a slash. */
static int exec_command(const struct exec_plan *plan, struct sbx_report *err)
{
    const char *name = plan->argv[0];
    const char *path;
    char candidate[4096];
    int saved = ENOENT;

    if (strchr(name, '/')) {
        execve(name, plan->argv, plan->envp);
        return fail(err, "execve", errno, "cannot execute %s: %s", name, strerror(errno));
    }
    path = env_lookup(plan->envp, "PATH");
    if (!path)
        path = DEFAULT_PATH;
    while (*path) {
        size_t dirlen = strcspn(path, ":");

        if (dirlen > 0 && (size_t)snprintf(candidate, sizeof candidate, "%.*s/%s", (int)dirlen,
                                           path, name) < sizeof candidate) {
            execve(candidate, plan->argv, plan->envp);
            if (errno != ENOENT && errno != ENOTDIR)
                saved = errno;
        }
        path += dirlen + (path[dirlen] == ':');
    }
    return fail(err, "execve", saved, "cannot execute %s: %s", name, strerror(saved));
}

/* The command process: each step is checked, and a failure is reported as a
 * structured error rather than an exit code the command might also use. */
static void __attribute__((noreturn)) run_command(const struct exec_plan *plan)
{
    struct sbx_report err;
    sigset_t none;

    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* A guest command must not share a controlling terminal with anything
     * (TIOCSTI would let it type into it). */
    if (setsid() < 0) {
        fail(&err, "setsid", errno, "cannot start a session: %s", strerror(errno));
        goto out;
    }
    if (dup2(plan->fds[SBX_FD_STDIN], 0) < 0 || dup2(plan->fds[SBX_FD_STDOUT], 1) < 0 ||
        dup2(plan->fds[SBX_FD_STDERR], 2) < 0) {
        fail(&err, "stdio", errno, "cannot set up stdio: %s", strerror(errno));
        goto out;
    }
    if (dup3(plan->fds[SBX_FD_REPLY], COMMAND_REPORT_FD, O_CLOEXEC) < 0 &&
        plan->fds[SBX_FD_REPLY] != COMMAND_REPORT_FD) {
        fail(&err, "stdio", errno, "cannot keep the report channel: %s", strerror(errno));
        goto out;
    }
    fcntl(COMMAND_REPORT_FD, F_SETFD, FD_CLOEXEC);
    if (sys_close_range(COMMAND_REPORT_FD + 1, ~0U) < 0) {
        fail(&err, "close_range", errno, "cannot close inherited fds: %s", strerror(errno));
        goto out_report;
    }
    if (limits_apply(plan->rlimits, &err) < 0)
        goto out_report;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
        fail(&err, "no_new_privs", errno, "cannot set no_new_privs: %s", strerror(errno));
        goto out_report;
    }
    if (drop_capabilities(&err) < 0)
        goto out_report;
    /* After dropping capabilities, so the guest's own permissions apply. */
    if (chdir(plan->cwd) < 0) {
        fail(&err, "chdir", errno, "cannot change directory to %s: %s", plan->cwd,
             strerror(errno));
        goto out_report;
    }
    exec_command(plan, &err);
out_report:
    report_send(COMMAND_REPORT_FD, &err);
    _exit(127);
out:
    report_send(plan->fds[SBX_FD_REPLY], &err);
    _exit(127);
}

static int command_main(void *plan)
{
    run_command(plan);
}

/* Like fork() + run_command(), but the child borrows our memory until it
 * execs (CLONE_VM | CLONE_VFORK, as posix_spawn does): no page tables to
 * copy on the command's critical path. The child runs on its own stack and
 * writes nothing of ours that we read afterwards. */
static pid_t spawn_command(const struct exec_plan *plan)
{
    static char stack[64 * 1024] __attribute__((aligned(16)));

    return clone(command_main, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, (void *)plan);
}

static int mount_private_fs(const char *fstype, const char *target, unsigned long flags,
                            const char *options, struct sbx_report *err)
{
    if (mount(fstype, target, fstype, flags, options) < 0)
        return fail(err, "mount", errno, "cannot mount %s on %s: %s", fstype, target,
                    strerror(errno));
    return 0;
}

/* The session's user namespace owns its UTS, IPC and network namespaces, so
 * their sysctls (hostname, ipc limits, net.*) appear writable by the guest
 * user: a bind of /proc/sys over itself, read-only, keeps them as set up. */
static int make_read_only(const char *path, struct sbx_report *err)
{
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0 ||
        mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        return fail(err, "mount", errno, "cannot make %s read-only: %s", path, strerror(errno));
    return 0;
}

/* An empty, size-bounded tmpfs for the command alone. */
static int mount_scratch(const char *target, unsigned long flags, unsigned long long bytes,
                         struct sbx_report *err)
{
    char options[64];

    snprintf(options, sizeof options, "mode=1777,size=%llu", bytes);
    return mount_private_fs("tmpfs", target, flags, options, err);
}

/* Parse one request into plan; strings point into buf. */
static int parse_request(char *buf, size_t len, struct exec_plan *plan, char **vectors,
                         size_t max_vectors, struct sbx_report *err)
{
    struct sbx_exec_request req;
    char *strings, *end;
    size_t count = 0;

    if (len < sizeof req)
        return fail(err, "request", EINVAL, "request too short");
    memcpy(&req, buf, sizeof req);
    if (req.version != SBX_PROTO_VERSION)
        return fail(err, "request", EPROTO, "protocol version %u, expected %u", req.version,
                    SBX_PROTO_VERSION);
    if (req.kind != SBX_REQUEST_EXEC)
        return fail(err, "request", EINVAL, "not a command");
    if (req.strings_len != len - sizeof req || req.strings_len == 0 || req.argc == 0)
        return fail(err, "request", EINVAL, "malformed request");
    if ((size_t)req.argc + req.envc + 2 > max_vectors)
        return fail(err, "request", E2BIG, "too many arguments");
    strings = buf + sizeof req;
    end = strings + req.strings_len;
    if (end[-1] != '\0')
        return fail(err, "request", EINVAL, "unterminated strings");
    plan->cwd = strings;
    strings += strlen(strings) + 1;
    plan->argv = vectors;
    for (uint32_t i = 0; i < req.argc; i++) {
        if (strings >= end)
            return fail(err, "request", EINVAL, "missing arguments");
        vectors[count++] = strings;
        strings += strlen(strings) + 1;
    }
    vectors[count++] = NULL;
    plan->envp = vectors + count;
    for (uint32_t i = 0; i < req.envc; i++) {
        if (strings >= end)
            return fail(err, "request", EINVAL, "missing environment");
        vectors[count++] = strings;
        strings += strlen(strings) + 1;
    }
    vectors[count] = NULL;
    if (strings != end)
        return fail(err, "request", EINVAL, "trailing data in request");
    memcpy(plan->rlimits, req.rlimits, sizeof plan->rlimits);
    return 0;
}

/* Wait for this init's one request. Returns 0 with plan filled, or -1 when the
 * holder went away first (nothing to report to). */
static int receive_plan(int request_fd, struct exec_plan *plan, struct sbx_report *err)
{
    static char buf[sizeof(struct sbx_exec_request) + SBX_MAX_REQUEST_STRINGS];
    static char *vectors[SBX_MAX_REQUEST_STRINGS / 2 + 2];
    int nfds;
    ssize_t len = receive_request(request_fd, buf, sizeof buf, plan->fds, &nfds, 0);

    if (len <= 0)
        return -1;
    if (nfds != SBX_NFDS) { /* the holder forwards only whole exec requests */
        for (int i = 0; i < nfds; i++)
            close(plan->fds[i]);
        return -1;
    }
    if (parse_request(buf, (size_t)len, plan, vectors, sizeof vectors / sizeof vectors[0], err) < 0)
        return 1;
    return 0;
}

/* A command's /tmp or /dev/shm, and what it was like when mounted. */
struct scratch_place {
    const char *path;
    int fd;          /* O_DIRECTORY, O_NOATIME: looking at it must not change it */
    struct stat made;
    ssize_t xattrs;  /* the length of its extended attributes' names */
    long flags;      /* its inode flags (chattr) */
};

/* What an init keeps to put its namespaces back after each command. */
struct init_state {
    struct scratch_place scratch[2];
    struct rlimit limits[RLIM_NLIMITS]; /* the init's own, which a command may lower (prlimit) */
    int last_pid;     /* /proc/sys/kernel/ns_last_pid, opened for writing before /proc/sys was made read-only */
    int mqueues;      /* a directory fd of this IPC namespace's mqueue file system, never attached anywhere */
};

static int remember_scratch(struct scratch_place *place)
{
    if (fstat(place->fd, &place->made) < 0 || (place->xattrs = flistxattr(place->fd, NULL, 0)) < 0 ||
        ioctl(place->fd, FS_IOC_GETFLAGS, &place->flags) < 0)
        return -1;
    return 0;
}

static int mount_scratch_place(struct scratch_place *place, unsigned long flags, unsigned long long bytes,
                               struct sbx_report *err)
{
    if (mount_scratch(place->path, flags, bytes, err) < 0)
        return -1;
    place->fd = open(place->path, O_RDONLY | O_DIRECTORY | O_NOATIME | O_CLOEXEC);
    if (place->fd < 0 || remember_scratch(place) < 0)
        return fail(err, "mount", errno, "cannot open %s: %s", place->path, strerror(errno));
    return 0;
}

static int same_time(const struct timespec *a, const struct timespec *b)
{
    return a->tv_sec == b->tv_sec && a->tv_nsec == b->tv_nsec;
}

/* The entries of a directory, a buffer at a time; 0 at the end, -1 on an
 * error. */
static long next_names(int fd, char *buf, size_t size)
{
    return syscall(SYS_getdents64, fd, buf, size);
}

static int is_dot(const char *name)
{
    return strcmp(name, ".") == 0 || strcmp(name, "..") == 0;
}

/* A scratch place as it was mounted: empty, with its own mode, owner,
 * times, inode flags and extended attributes (an ACL is one). Nothing else
 * of an empty tmpfs can carry anything, and nothing can be made below it
 * without changing it. Even reading it can (its access time). */
static int scratch_untouched(const struct scratch_place *place)
{
    char entries[1024] __attribute__((aligned(8)));
    const struct stat *made = &place->made;
    struct stat now;
    long flags, n;

    if (ioctl(place->fd, FS_IOC_GETFLAGS, &flags) < 0 || flags != place->flags || fstat(place->fd, &now) < 0 ||
        now.st_mode != made->st_mode || now.st_uid != made->st_uid || now.st_gid != made->st_gid ||
        now.st_nlink != made->st_nlink || now.st_size != made->st_size || !same_time(&now.st_atim, &made->st_atim) ||
        !same_time(&now.st_mtim, &made->st_mtim) || !same_time(&now.st_ctim, &made->st_ctim) ||
        flistxattr(place->fd, NULL, 0) != place->xattrs || lseek(place->fd, 0, SEEK_SET) < 0)
        return 0;
    n = next_names(place->fd, entries, sizeof entries);
    for (long at = 0; n > 0 && at < n;) {
        struct dirent64 *entry = (struct dirent64 *)(entries + at);

        if (!is_dot(entry->d_name))
            return 0;
        at += entry->d_reclen;
    }
    return n >= 0;
}

/* Remove everything in the directory fd: passes over it until one finds
 * nothing left, a subdirectory emptied the same way first. The init may
 * (it holds CAP_DAC_OVERRIDE over the guest's files); a tree deeper than
 * CLEAR_DEPTH is not cleared, and the init goes rather than be reused. */
#define CLEAR_DEPTH 64

static int clear_directory(int fd, int depth)
{
    char entries[4096] __attribute__((aligned(8)));
    int removed;

    if (depth > CLEAR_DEPTH) {
        errno = ELOOP;
        return -1;
    }
    do {
        long n;

        removed = 0;
        if (lseek(fd, 0, SEEK_SET) < 0)
            return -1;
        while ((n = next_names(fd, entries, sizeof entries)) > 0) {
            for (long at = 0; at < n;) {
                struct dirent64 *entry = (struct dirent64 *)(entries + at);
                int sub;

                at += entry->d_reclen;
                if (is_dot(entry->d_name))
                    continue;
                if (unlinkat(fd, entry->d_name, 0) == 0) {
                    removed = 1;
                    continue;
                }
                if (errno != EISDIR)
                    return -1;
                sub = openat(fd, entry->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (sub < 0)
                    return -1;
                if (clear_directory(sub, depth + 1) < 0) {
                    int e = errno;
                    close(sub);
                    errno = e;
                    return -1;
                }
                close(sub);
                if (unlinkat(fd, entry->d_name, AT_REMOVEDIR) < 0)
                    return -1;
                removed = 1;
            }
        }
        if (n < 0)
            return -1;
    } while (removed);
    return 0;
}

/* A scratch place back as it was mounted: emptied, then its extended
 * attributes removed and its flags, mode, owner and times made a new
 * mount's. */
static int restore_scratch(struct scratch_place *place, struct sbx_report *err)
{
    char names[4096];
    ssize_t len;

    if (clear_directory(place->fd, 0) < 0)
        return fail(err, "reset", errno, "cannot empty %s: %s", place->path, strerror(errno));
    len = flistxattr(place->fd, names, sizeof names);
    for (ssize_t at = 0; len > 0 && at < len; at += (ssize_t)strlen(names + at) + 1)
        if (fremovexattr(place->fd, names + at) < 0)
            return fail(err, "reset", errno, "cannot clear %s's attributes: %s", place->path, strerror(errno));
    if (len < 0 || ioctl(place->fd, FS_IOC_SETFLAGS, &place->flags) < 0 ||
        fchown(place->fd, place->made.st_uid, place->made.st_gid) < 0 ||
        fchmod(place->fd, place->made.st_mode & 07777) < 0 || futimens(place->fd, NULL) < 0 ||
        remember_scratch(place) < 0)
        return fail(err, "reset", errno, "cannot restore %s: %s", place->path, strerror(errno));
    return 0;
}

/* Every SysV object of this IPC namespace (there are seldom any: counting
 * them is three calls), by the ids /proc/sysvipc lists. */
static int remove_sysv_objects(struct sbx_report *err)
{
    static const char *const kinds[3] = {"shm", "sem", "msg"};
    struct shm_info shm;
    struct seminfo sem;
    struct msginfo msg;

    if (shmctl(0, SHM_INFO, (struct shmid_ds *)&shm) < 0 || semctl(0, 0, SEM_INFO, &sem) < 0 ||
        msgctl(0, MSG_INFO, (struct msqid_ds *)&msg) < 0)
        return fail(err, "reset", errno, "cannot count IPC objects: %s", strerror(errno));
    if (shm.used_ids == 0 && sem.semusz == 0 && msg.msgpool == 0)
        return 0;
    for (int kind = 0; kind < 3; kind++) {
        char path[32], line[512];
        FILE *listing;

        snprintf(path, sizeof path, "/proc/sysvipc/%s", kinds[kind]);
        listing = fopen(path, "re");
        if (!listing)
            return fail(err, "reset", errno, "cannot list %s: %s", path, strerror(errno));
        fgets(line, sizeof line, listing); /* the header */
        while (fgets(line, sizeof line, listing)) {
            int key, id, rc;

            if (sscanf(line, "%d %d", &key, &id) != 2)
                continue;
            rc = kind == 0 ? shmctl(id, IPC_RMID, NULL) : kind == 1 ? semctl(id, 0, IPC_RMID) : msgctl(id, IPC_RMID, NULL);
            if (rc < 0 && errno != EINVAL && errno != EIDRM) {
                int e = errno;
                fclose(listing);
                return fail(err, "reset", e, "cannot remove a SysV %s object: %s", kinds[kind], strerror(e));
            }
        }
        fclose(listing);
    }
    return 0;
}

/* Once per init: the handles the resets need. The mqueue file system is
 * mounted detached, so no guest sees it; it shows this IPC namespace's
 * queues. */
static int open_reset_handles(struct init_state *state, struct sbx_report *err)
{
    int fs, mnt;

    for (int resource = 0; resource < RLIM_NLIMITS; resource++)
        if (prlimit(0, resource, NULL, &state->limits[resource]) < 0)
            return fail(err, "rlimits", errno, "cannot read the init's limits: %s", strerror(errno));
    state->last_pid = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    if (state->last_pid < 0)
        return fail(err, "mount", errno, "cannot open ns_last_pid: %s", strerror(errno));
    fs = sys_fsopen("mqueue", FSOPEN_CLOEXEC);
    if (fs < 0)
        return fail(err, "mount", errno, "cannot open a message queue file system: %s", strerror(errno));
    if (sys_fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0 || (mnt = sys_fsmount(fs, FSMOUNT_CLOEXEC, 0)) < 0) {
        int e = errno;
        close(fs);
        return fail(err, "mount", e, "cannot mount a message queue file system: %s", strerror(e));
    }
    close(fs);
    state->mqueues = openat(mnt, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    close(mnt);
    if (state->mqueues < 0)
        return fail(err, "mount", errno, "cannot open the message queue file system: %s", strerror(errno));
    return 0;
}

/* Put the namespaces back as a new init has them (see the top of the file). */
static int reset_namespaces(struct init_state *state, struct sbx_report *err)
{
    for (int i = 0; i < 2; i++)
        if (!scratch_untouched(&state->scratch[i]) && restore_scratch(&state->scratch[i], err) < 0)
            return -1;
    if (remove_sysv_objects(err) < 0)
        return -1;
    /* The mqueue file system has no directories: emptying it removes every queue. */
    if (clear_directory(state->mqueues, 0) < 0)
        return fail(err, "reset", errno, "cannot remove the message queues: %s", strerror(errno));
    /* A command may lower its init's limits (it has the init's ids), and the
     * init cannot raise a hard one again: such an init goes. */
    for (int resource = 0; resource < RLIM_NLIMITS; resource++) {
        struct rlimit now;

        if (prlimit(0, resource, NULL, &now) < 0 || now.rlim_cur != state->limits[resource].rlim_cur ||
            now.rlim_max != state->limits[resource].rlim_max)
            return fail(err, "reset", EPERM, "the command changed its init's limits");
    }
    /* The next command is pid 2, as in a new pid namespace. */
    if (pwrite(state->last_pid, "1", 1, 0) != 1)
        return fail(err, "reset", errno, "cannot reset the next pid: %s", strerror(errno));
    return 0;
}

static void close_plan_fds(struct exec_plan *plan)
{
    for (int i = 0; i < SBX_NFDS; i++)
        if (plan->fds[i] >= 0)
            close(plan->fds[i]);
}

static void tell_holder(int request_fd, char what)
{
    while (send(request_fd, &what, 1, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

/* Run one command to the end of its tree; its wait status, or -1 if it
 * could not be forked. */
static int run_one(struct exec_plan *plan, struct sbx_report *err)
{
    int status, command_status = 0, command_done = 0;
    pid_t pid = spawn_command(plan);

    if (pid < 0)
        return fail(err, "fork", errno, "cannot fork the command: %s", strerror(errno));
    command_pid = pid;
    /* stdout and stderr stay open here until after EXITED is sent: the host
     * then wakes once, for the report, and reads what the tree left in the
     * pipes, rather than first for their end-of-file and then again. */
    close(plan->fds[SBX_FD_STDIN]);
    plan->fds[SBX_FD_STDIN] = -1;

    /* Reap everything; once the command is gone, kill the rest. As pid 1,
     * kill(-1) reaches every other process in this namespace. */
    for (;;) {
        pid_t reaped = waitpid(-1, &status, 0);

        if (reaped < 0) {
            if (errno == EINTR)
                continue;
            break; /* ECHILD: the namespace is empty but for us */
        }
        if (reaped == pid) {
            command_status = status;
            command_done = 1;
            command_pid = 0;
        }
        if (command_done)
            kill(-1, SIGKILL);
    }
    return command_status;
}

/* pid 1 of the commands' pid namespace. It keeps the holder's stdio
 * (/dev/null) open so the fds it receives land above 2, where setting up the
 * command's stdio cannot clobber them. */
static void __attribute__((noreturn)) run_init(const struct command_settings *settings, int request_fd)
{
    struct sigaction forward = {.sa_handler = forward_signal};
    struct init_state state = {.scratch = {{.path = "/tmp"}, {.path = "/dev/shm"}}};
    struct exec_plan plan = {.fds = {-1, -1, -1, -1}};
    struct sbx_report err;
    int setup_failed = 0;

    /* If the holder dies, so does the init and with it the whole tree. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        setup_failed = fail(&err, "pdeathsig", errno, "cannot set the parent-death signal: %s",
                            strerror(errno));
    else if (close_fds_except((int[]){0, 1, 2, request_fd}, 4) < 0)
        setup_failed = fail(&err, "close_range", errno, "cannot close the holder's fds: %s",
                            strerror(errno));
    else if (mount_scratch_place(&state.scratch[0], MS_NOSUID | MS_NODEV, settings->tmp_bytes, &err) < 0 ||
             mount_scratch_place(&state.scratch[1], MS_NOSUID | MS_NODEV | MS_NOEXEC, SBX_SHM_BYTES, &err) < 0 ||
             mount_private_fs("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL, &err) < 0 ||
             open_reset_handles(&state, &err) < 0 || make_read_only("/proc/sys", &err) < 0 ||
             /* Once its mounts are made: the rest of the filter, which the
              * command inherits through its clone. Everything the init and
              * the command still do before execve is allowed, and loading it
              * here keeps that work off the requests' path. */
             seccomp_install(&settings->seccomp, &err) < 0)
        setup_failed = 1;
    sigemptyset(&forward.sa_mask);
    sigaction(SIGTERM, &forward, NULL);
    sigaction(SIGINT, &forward, NULL);
    sigaction(SIGHUP, &forward, NULL);

    for (;;) {
        int status;

        /* A failed setup is reported to the request that would have used it. */
        switch (receive_plan(request_fd, &plan, setup_failed ? &(struct sbx_report){0} : &err)) {
        case -1:
            _exit(0);
        case 1:
            goto fail;
        }
        if (setup_failed || (status = run_one(&plan, &err)) < 0)
            goto fail;
        /* The holder stops taking the host's closing the command's socket
         * for giving up on it, before the host hears it is over. */
        tell_holder(request_fd, INIT_DONE);
        report_exit_status(plan.fds[SBX_FD_REPLY], status);
        close_plan_fds(&plan);
        /* An init that will not serve again (see serve.c), or cannot put
         * its namespaces back, goes (having reported its command), and the
         * holder makes a new one. */
        if (!settings->reuse_inits || reset_namespaces(&state, &err) < 0)
            _exit(0);
        tell_holder(request_fd, INIT_READY);
    }
fail:
    report_send(plan.fds[SBX_FD_REPLY], &err);
    _exit(1);
}

pid_t spawn_idle_init(const struct command_settings *settings, int *pidfd, int *request_fd,
                      struct sbx_report *err)
{
    int pair[2];
    pid_t pid;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0)
        return fail(err, "socketpair", errno, "cannot create a request socket: %s", strerror(errno));
    /* A fresh IPC namespace too: SysV objects and POSIX message queues of
     * one command never meet the next, just like its /tmp and /dev/shm. */
    pid = sys_clone3_fork(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC, pidfd);
    if (pid < 0) {
        close(pair[0]);
        close(pair[1]);
        return fail(err, "clone3", errno, "cannot create the command's namespaces: %s",
                    strerror(errno));
    }
    if (pid == 0)
        run_init(settings, pair[1]);
    close(pair[1]);
    *request_fd = pair[0];
    return pid;
}
