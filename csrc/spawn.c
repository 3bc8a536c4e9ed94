/* One command: a per-command init in fresh mount and pid namespaces, and the
 * command itself under it.
 *
 *   holder --clone3(NEWNS|NEWPID)--> init (pid 1) --fork--> command (pid 2)
 *
 * The holder prepares the next init before any request arrives: creating the
 * namespaces and mounting an empty /tmp, /dev/shm and the init's own /proc is
 * most of a command's setup cost, and this takes it off the request's path.
 * The prepared init waits on its own socket for one request (the same message
 * the host sent, with the same fds), forks the command, forwards termination
 * signals to it, and when it exits kills and reaps every other process in the
 * namespace (including ones that setsid() or double-forked away) before
 * reporting the exit status. So when the host sees EXITED, the command's whole
 * tree is gone. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
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

/* pid 1 of the command's pid namespace. It keeps the holder's stdio
 * (/dev/null) open so the fds it receives land above 2, where setting up the
 * command's stdio cannot clobber them. */
static void __attribute__((noreturn)) run_init(const struct command_settings *settings, int request_fd)
{
    struct sigaction forward = {.sa_handler = forward_signal};
    struct exec_plan plan;
    struct sbx_report err;
    int status = 0, command_status = 0, command_done = 0, setup_failed = 0;
    pid_t pid;

    /* If the holder dies, so does the init and with it the whole tree. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        setup_failed = fail(&err, "pdeathsig", errno, "cannot set the parent-death signal: %s",
                            strerror(errno));
    else if (close_fds_except((int[]){0, 1, 2, request_fd}, 4) < 0)
        setup_failed = fail(&err, "close_range", errno, "cannot close the holder's fds: %s",
                            strerror(errno));
    else if (mount_scratch("/tmp", MS_NOSUID | MS_NODEV, settings->tmp_bytes, &err) < 0 ||
             mount_scratch("/dev/shm", MS_NOSUID | MS_NODEV | MS_NOEXEC, SBX_SHM_BYTES, &err) < 0 ||
             mount_private_fs("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL, &err) < 0 ||
             make_read_only("/proc/sys", &err) < 0 ||
             /* Once its mounts are made: the rest of the filter, which the
              * command inherits through its clone. Everything the init and
              * the command still do before execve is allowed, and loading it
              * here keeps that work off the request's path. */
             seccomp_install(&settings->seccomp, &err) < 0)
        setup_failed = 1;
    sigemptyset(&forward.sa_mask);
    sigaction(SIGTERM, &forward, NULL);
    sigaction(SIGINT, &forward, NULL);
    sigaction(SIGHUP, &forward, NULL);

    /* A failed setup is reported to the request that would have used it. */
    switch (receive_plan(request_fd, &plan, setup_failed ? &(struct sbx_report){0} : &err)) {
    case -1:
        _exit(0);
    case 1:
        goto fail;
    }
    close(request_fd);
    if (setup_failed)
        goto fail;

    pid = spawn_command(&plan);
    if (pid < 0) {
        fail(&err, "fork", errno, "cannot fork the command: %s", strerror(errno));
        goto fail;
    }
    command_pid = pid;
    /* stdout and stderr stay open here until after EXITED is sent: the host
     * then wakes once, for the report, and reads what the tree left in the
     * pipes, rather than first for their end-of-file and then again. */
    close(plan.fds[SBX_FD_STDIN]);

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
    report_exit_status(plan.fds[SBX_FD_REPLY], command_status);
    _exit(0);
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
