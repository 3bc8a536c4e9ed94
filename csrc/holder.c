/* sandboxns-holder: one per sandbox session.
 *
 * The host execs this program (never a fork of the Python interpreter, so no
 * sandbox process ever holds a copy of the host's memory) with its end of the
 * control socket as fd 3 (and, for a backend session, its lease file as fd 4).
 * It:
 *   1. unshares the session's namespaces and maps the host user (userns.c);
 *   2. forks pid 1 of the new pid namespace, the holder proper, reports its
 *      pid (STARTED) and stays behind only to wait for it (the host tracks
 *      this process's pidfd);
 *   3. builds the root filesystem and pivots into it (rootfs.c), brings up
 *      lo (net.c), and reports READY on the control socket;
 *   4. serves command requests (serve.c, spawn.c) until the control socket
 *      closes, at which point pid 1 exits and the kernel kills the session.
 *
 * `sandboxns-holder --init ...` and `--enter ...` are other programs in the
 * same binary: the bwrap driver's pid 1 inside bwrap's sandbox
 * (bwrap_init.c), and its way to start bwrap where the session lives (its
 * cgroup, a root host's mount namespace; enter.c).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "holder.h"

static int parse_number(const char *text, unsigned long long most, unsigned long long *out)
{
    char *end;
    unsigned long long value;

    errno = 0;
    value = strtoull(text, &end, 10);
    if (errno || *end || end == text || *text == '-' || value > most)
        return -1;
    *out = value;
    return 0;
}

static int parse_id(const char *text, unsigned int *out)
{
    unsigned long long value;

    if (parse_number(text, 0xfffffffeULL, &value) < 0)
        return -1;
    *out = (unsigned int)value;
    return 0;
}

static int parse_seccomp_denial(const char *text, struct holder_config *cfg, struct sbx_report *err)
{
    unsigned long long nr;

    if (cfg->nseccomp_denied == SBX_SECCOMP_MAX_EXTRA)
        return fail(err, "arguments", E2BIG, "more than %d --seccomp-deny options", SBX_SECCOMP_MAX_EXTRA);
    if (parse_number(text, 0xffffffffULL, &nr) < 0)
        return fail(err, "arguments", EINVAL, "bad --seccomp-deny %s (want a syscall number)", text);
    cfg->seccomp_denied[cfg->nseccomp_denied++] = (uint32_t)nr;
    return 0;
}

/* UID:GID, the unprivileged host user a root host's guest runs as. */
static int parse_host_ids(char *text, struct holder_config *cfg, struct sbx_report *err)
{
    char *colon = strchr(text, ':');

    if (!colon)
        return fail(err, "arguments", EINVAL, "bad --host-ids %s (want UID:GID)", text);
    *colon = '\0';
    if (parse_id(text, &cfg->outer_uid) < 0 || parse_id(colon + 1, &cfg->outer_gid) < 0 || cfg->outer_uid == 0 ||
        cfg->outer_gid == 0)
        return fail(err, "arguments", EINVAL, "bad --host-ids (want an unprivileged UID:GID)");
    if (getuid() != 0)
        return fail(err, "arguments", EPERM, "--host-ids is for a root host");
    cfg->host_ids = 1;
    return 0;
}

/* MODE:GUEST:HOST, MODE "ro" or "rw"; the guest path has no ':' (the host
 * checks that), so the host path may. */
static int parse_bind(char *text, struct holder_config *cfg, struct sbx_report *err)
{
    struct extra_bind *bind = &cfg->extra_binds[cfg->nextra_binds];
    char *guest, *host;

    if (cfg->nextra_binds == MAX_EXTRA_BINDS)
        return fail(err, "arguments", E2BIG, "more than %d --bind options", MAX_EXTRA_BINDS);
    guest = strchr(text, ':');
    host = guest ? strchr(guest + 1, ':') : NULL;
    if (!host || guest - text != 2 || (strncmp(text, "ro", 2) != 0 && strncmp(text, "rw", 2) != 0) ||
        guest[1] != '/' || host[1] != '/')
        return fail(err, "arguments", EINVAL, "bad --bind %s (want ro|rw:/GUEST:/HOST)", text);
    *host = '\0';
    bind->writable = text[1] == 'w';
    bind->guest = guest + 1;
    bind->host = host + 1;
    bind->tree_fd = -1;
    cfg->nextra_binds++;
    return 0;
}

static int parse_args(int argc, char **argv, struct holder_config *cfg, struct sbx_report *err)
{
    static const struct option options[] = {
        {"uid", required_argument, NULL, 'u'},       {"gid", required_argument, NULL, 'g'},
        {"workspace", required_argument, NULL, 'w'}, {"hostname", required_argument, NULL, 'h'},
        {"share-network", no_argument, NULL, 'n'},   {"overlay-lower", required_argument, NULL, 'l'},
        {"overlay-work", required_argument, NULL, 'o'}, {"gateway-dir", required_argument, NULL, 's'},
        {"bind", required_argument, NULL, 'b'},      {"tmp-bytes", required_argument, NULL, 't'},
        {"seccomp-relax", required_argument, NULL, 'r'}, {"seccomp-deny", required_argument, NULL, 'd'},
        {"host-ids", required_argument, NULL, 'i'},  {"proxy-port", required_argument, NULL, 'p'},
        {"template-store", required_argument, NULL, 'T'}, {"snapshot-store", required_argument, NULL, 'S'},
        {"image-root", required_argument, NULL, 'R'},
        {NULL, 0, NULL, 0},
    };
    unsigned long long number;
    int opt;

    cfg->inner_uid = cfg->inner_gid = 1000;
    cfg->commands.tmp_bytes = SBX_TMP_BYTES;
    cfg->outer_uid = getuid();
    cfg->outer_gid = getgid();
    cfg->prepared.workspace = cfg->prepared.overlay_tree = cfg->prepared.gateway_dir = cfg->prepared.image_root = -1;
    for (int i = 0; i < MAX_OVERLAY_LOWERS; i++)
        cfg->prepared.overlay_lowers[i] = -1;
    for (int i = 0; i < NSTORES; i++)
        cfg->prepared.stores[i] = -1;
    cfg->hostname = "sandbox";
    while ((opt = getopt_long(argc, argv, "", options, NULL)) != -1) {
        switch (opt) {
        case 'u':
            if (parse_id(optarg, &cfg->inner_uid) < 0)
                return fail(err, "arguments", EINVAL, "bad uid %s", optarg);
            break;
        case 'g':
            if (parse_id(optarg, &cfg->inner_gid) < 0)
                return fail(err, "arguments", EINVAL, "bad gid %s", optarg);
            break;
        case 'w':
            cfg->workspace = optarg;
            break;
        case 'h':
            cfg->hostname = optarg;
            break;
        case 'n':
            cfg->share_network = 1;
            break;
        case 'l':
            if (cfg->noverlay_lowers == MAX_OVERLAY_LOWERS)
                return fail(err, "arguments", E2BIG, "more than %d --overlay-lower layers", MAX_OVERLAY_LOWERS);
            cfg->overlay_lowers[cfg->noverlay_lowers++] = optarg;
            break;
        case 'o':
            cfg->overlay_work = optarg;
            break;
        case 's':
            cfg->gateway_dir = optarg;
            break;
        case 'b':
            if (parse_bind(optarg, cfg, err) < 0)
                return -1;
            break;
        case 't':
            if (parse_number(optarg, ~0ULL, &number) < 0 || number == 0)
                return fail(err, "arguments", EINVAL, "bad --tmp-bytes %s", optarg);
            cfg->commands.tmp_bytes = number;
            break;
        case 'r':
            if (parse_number(optarg, 0xffffffffULL, &number) < 0)
                return fail(err, "arguments", EINVAL, "bad --seccomp-relax %s", optarg);
            cfg->seccomp_relaxed = (uint32_t)number;
            break;
        case 'd':
            if (parse_seccomp_denial(optarg, cfg, err) < 0)
                return -1;
            break;
        case 'i':
            if (parse_host_ids(optarg, cfg, err) < 0)
                return -1;
            break;
        case 'T':
            cfg->stores[STORE_TEMPLATES] = optarg;
            break;
        case 'S':
            cfg->stores[STORE_SNAPSHOTS] = optarg;
            break;
        case 'R':
            if (optarg[0] != '/')
                return fail(err, "arguments", EINVAL, "bad --image-root %s (want an absolute path)", optarg);
            cfg->image_root = optarg;
            break;
        case 'p':
            if (parse_number(optarg, 65535, &number) < 0 || number == 0)
                return fail(err, "arguments", EINVAL, "bad --proxy-port %s", optarg);
            cfg->proxy_port = (unsigned int)number;
            break;
        default:
            return fail(err, "arguments", EINVAL, "unknown argument");
        }
    }
    if (!cfg->workspace || optind != argc)
        return fail(err, "arguments", EINVAL, "usage: sandboxns-holder --workspace DIR [options]");
    if (!cfg->noverlay_lowers != !cfg->overlay_work)
        return fail(err, "arguments", EINVAL, "--overlay-lower and --overlay-work go together");
    if ((cfg->stores[STORE_TEMPLATES] || cfg->stores[STORE_SNAPSHOTS]) &&
        !(cfg->noverlay_lowers && cfg->stores[STORE_TEMPLATES] && cfg->stores[STORE_SNAPSHOTS]))
        return fail(err, "arguments", EINVAL, "the layer stores go together, with an overlay");
    if (cfg->proxy_port && cfg->share_network)
        return fail(err, "arguments", EINVAL, "--proxy-port needs the session's own network");
    return 0;
}

/* Python ignores SIGPIPE and the ignored disposition survives execve; a guest
 * must start with every signal at its default. */
static void reset_signals(void)
{
    sigset_t none;

    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* The prepared layers of the workspace's overlay and of the root's, which
 * the overlays hold on to by now. */
static void close_prepared_layers(const struct prepared_trees *prepared)
{
    if (prepared->overlay_tree >= 0)
        close(prepared->overlay_tree);
    for (int i = 0; i < MAX_OVERLAY_LOWERS; i++)
        if (prepared->overlay_lowers[i] >= 0)
            close(prepared->overlay_lowers[i]);
    for (int i = 0; i < NSTORES; i++)
        if (prepared->stores[i] >= 0)
            close(prepared->stores[i]);
    if (prepared->image_root >= 0)
        close(prepared->image_root);
}

static volatile pid_t holder_pid;

static void kill_holder(int sig)
{
    (void)sig;
    kill(holder_pid, SIGKILL);
}

/* The launcher outlives everything in the session: pid 1 of a pid namespace
 * becomes waitable only after the kernel has killed and reaped every other
 * process in it. So while this process runs, session processes may exist,
 * and it keeps the session's lease (LEASE_FD) locked until then. The host's
 * death reaches it as SIGTERM (its parent-death signal), which it turns into
 * SIGKILL for pid 1 before waiting as usual. */
static int wait_for_holder(pid_t holder, pid_t host)
{
    struct sigaction kill_on_term = {.sa_handler = kill_holder};
    int status;

    holder_pid = holder;
    sigaction(SIGTERM, &kill_on_term, NULL);
    if (getppid() != host) /* the host died before the handler was in place */
        kill(holder, SIGKILL);
    while (waitpid(holder, &status, 0) < 0)
        if (errno != EINTR)
            return 1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

int main(int argc, char **argv)
{
    struct holder_config cfg = {0};
    struct overlay_stack stack;
    struct sbx_report err;
    pid_t holder;
    int passed[3], npassed = 1;
    pid_t host = getppid();

    if (argc > 1 && strcmp(argv[1], "--init") == 0)
        return bwrap_init_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "--enter") == 0)
        return enter_main(argc, argv);
    /* What the bwrap driver runs to see that a session starts at all: the
     * one program every guest has, whatever its root filesystem. */
    if (argc == 2 && strcmp(argv[1], "--version") == 0)
        return puts("sandboxns-holder") == EOF;
    reset_signals();
    if (parse_args(argc, argv, &cfg, &err) < 0 || compile_seccomp(&cfg, &err) < 0 ||
        (cfg.host_ids && userns_prepare_host_ids(&cfg, &err) < 0) || userns_enter(&cfg, &err) < 0 ||
        userns_forbid_nesting(&err) < 0)
        goto report;
    /* Neither the launcher, the holder nor any command's init (forks of it)
     * may be opened through /proc/PID/mem or ptrace by a guest of the same
     * user: they keep capabilities in the session's namespaces. Only now,
     * because a non-dumpable process's /proc/self files belong to root,
     * and an unprivileged one writes its own uid_map above. A command's
     * execve makes the command itself dumpable again. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) {
        fail(&err, "dumpable", errno, "cannot make the holder non-dumpable: %s", strerror(errno));
        goto report;
    }
    holder = fork();
    if (holder < 0) {
        fail(&err, "fork", errno, "cannot start the holder: %s", strerror(errno));
        goto report;
    }
    if (holder > 0) {
        report_send(CONTROL_FD, &(struct sbx_report){.kind = SBX_REPORT_STARTED, .pid = holder});
        close(CONTROL_FD);
        return wait_for_holder(holder, host);
    }
    close(LEASE_FD); /* the launcher's to keep, not the session's */

    /* pid 1 of the session's pid namespace from here on. The parent carries
     * PR_SET_PDEATHSIG for the host; this one chains it, and also exits when
     * the host's end of the control socket closes. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) {
        fail(&err, "pdeathsig", errno, "cannot set the parent-death signal: %s", strerror(errno));
        goto report;
    }
    overlay_stack_init(&stack);
    if (rootfs_build(&cfg, &stack, &err) < 0)
        goto report;
    close_prepared_layers(&cfg.prepared);
    if (sethostname(cfg.hostname, strlen(cfg.hostname)) < 0) {
        fail(&err, "hostname", errno, "cannot set the hostname: %s", strerror(errno));
        goto report;
    }
    if (!cfg.share_network && net_loopback_up(&err) < 0)
        goto report;
    /* passed[0] is /workspace (below), then the proxy's listeners. */
    if (cfg.proxy_port) {
        int listeners = net_proxy_listen(cfg.proxy_port, passed + 1, &err);

        if (listeners < 0)
            goto report;
        npassed += listeners;
    }
    if (userns_empty_bounding_set(&err) < 0)
        goto report;
    /* Its own setup done, the holder needs no more than it serves with:
     * forks of itself, namespaces and mounts for each command's init. */
    if (seccomp_install(&cfg.session_seccomp, &err) < 0)
        goto report;
    passed[0] = open("/workspace", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (passed[0] < 0) {
        fail(&err, "workspace", errno, "cannot open /workspace: %s", strerror(errno));
        goto report;
    }
    report_send_with_fds(CONTROL_FD, &(struct sbx_report){.kind = SBX_REPORT_READY}, passed, npassed);
    /* The host has its own copies; no command may inherit these. */
    for (int i = 0; i < npassed; i++)
        close(passed[i]);
    /* With the host's network shared, a command reaches processes outside
     * the session (abstract sockets), which could keep a hold on its
     * namespaces: no init serves a second command (see serve.c). */
    cfg.commands.reuse_inits = !cfg.share_network;
    return holder_serve(CONTROL_FD, &cfg.commands, &stack);
report:
    report_send(CONTROL_FD, &err);
    return 1;
}
