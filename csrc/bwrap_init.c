/* sandboxns-holder --init REPORT_FD LIMITS PROXY -- COMMAND [ARG...]
 *
 * pid 1 of a bwrap driver's command: bwrap execs this (--as-pid-1) in place
 * of its own reaper, which runs as the guest's user, without capabilities,
 * in the guest's pid namespace, and dumpable. Any guest could then open the
 * reaper's /proc/1/mem and run code as it, or take its fds (pidfd_getfd):
 * ptrace rights over a process of one's own user need nothing else. This
 * init makes itself non-dumpable before the command exists; from then on
 * those rights need CAP_SYS_PTRACE over the user namespace it was exec'd in,
 * which no guest has (bwrap dropped every capability there). It installs no
 * signal handler, so the kernel drops every signal a guest sends it (pid 1
 * of a namespace gets, from inside, only the signals it handles); the host
 * signals the command directly, and SIGKILLs this init to end the tree.
 *
 * The command, its only child, gets LIMITS (the SBX_NRLIMITS values of enum
 * sbx_rlimit_index, comma-separated, "-" to inherit) and no fd but stdio.
 * bwrap knows nothing of rlimits, and setting them on bwrap itself would
 * count the host user's processes against RLIMIT_NPROC at bwrap's clone;
 * here they count only the command's. A failure to start it is written to
 * REPORT_FD in bwrap's own words ("execvp NAME: reason"), so the host tells
 * it from the command's exit status; a successful exec closes the command's
 * copy (close-on-exec), and the init closes its own at once.
 *
 * PROXY is "-", or PORT:FD for a command whose session has an egress
 * gateway: the init, in the command's network namespace (bwrap makes one
 * per command), listens there for the gateway's proxy (see net.c) and sends
 * the listeners over FD, a socket to the host, before the command exists.
 *
 * When the command ends, so does the init, with the command's exit status
 * (128+N for signal N, as bwrap reports it); the kernel then kills whatever
 * else is left in the pid namespace before bwrap sees the init go. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

/* Where the report channel is kept: right above stdio. */
#define REPORT_FD_IN_INIT 3

static int parse_limits(const char *text, uint64_t values[SBX_NRLIMITS])
{
    for (int i = 0; i < SBX_NRLIMITS; i++) {
        char *end;

        if (text[0] == '-') {
            values[i] = SBX_RLIMIT_INHERIT;
            end = (char *)text + 1;
        } else {
            errno = 0;
            values[i] = strtoull(text, &end, 10);
            if (errno || end == text)
                return -1;
        }
        if (*end != (i == SBX_NRLIMITS - 1 ? '\0' : ','))
            return -1;
        text = end + 1;
    }
    return 0;
}

static void __attribute__((noreturn)) run_command(const uint64_t limits[SBX_NRLIMITS], char **argv)
{
    struct sbx_report err;

    if (limits_apply(limits, &err) < 0)
        dprintf(REPORT_FD_IN_INIT, "%s: %s", err.step, err.message);
    else {
        execvp(argv[0], argv);
        dprintf(REPORT_FD_IN_INIT, "execvp %s: %s", argv[0], strerror(errno));
    }
    _exit(127);
}

static int exit_status_of(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 255;
}

/* PROXY: "-", or PORT:FD. */
static int parse_proxy(const char *text, unsigned int *port, int *fd)
{
    char *end;
    unsigned long number;

    *port = 0;
    *fd = -1;
    if (strcmp(text, "-") == 0)
        return 0;
    number = strtoul(text, &end, 10);
    if (end == text || *end != ':' || number == 0 || number > 65535)
        return -1;
    *port = (unsigned int)number;
    text = end + 1;
    number = strtoul(text, &end, 10);
    if (end == text || *end || number <= REPORT_FD_IN_INIT || number > 65535)
        return -1;
    *fd = (int)number;
    return 0;
}

/* Listen for the proxy here and hand the listeners to the host. */
static int hand_over_proxy(unsigned int port, int fd)
{
    struct sbx_report err;
    int listeners[2];
    int count = net_proxy_listen(port, listeners, &err);

    if (count < 0) {
        dprintf(REPORT_FD_IN_INIT, "%s: %s", err.step, err.message);
        return -1;
    }
    if (send_with_fds(fd, "L", 1, listeners, count) < 0) {
        dprintf(REPORT_FD_IN_INIT, "proxy: cannot hand the listeners over: %s", strerror(errno));
        return -1;
    }
    for (int i = 0; i < count; i++)
        close(listeners[i]);
    return 0;
}

int bwrap_init_main(int argc, char **argv)
{
    uint64_t limits[SBX_NRLIMITS];
    unsigned int proxy_port;
    int report_fd, proxy_fd, status;
    pid_t command;

    if (argc < 7 || strcmp(argv[5], "--") != 0 || parse_limits(argv[3], limits) < 0 ||
        parse_proxy(argv[4], &proxy_port, &proxy_fd) < 0 || (report_fd = atoi(argv[2])) <= 2) {
        fprintf(stderr, "usage: sandboxns-holder --init REPORT_FD LIMITS PROXY -- COMMAND [ARG...]\n");
        return 127;
    }
    if (dup3(report_fd, REPORT_FD_IN_INIT, O_CLOEXEC) < 0 && report_fd != REPORT_FD_IN_INIT) {
        fprintf(stderr, "sandboxns-holder --init: bad report fd: %s\n", strerror(errno));
        return 127;
    }
    fcntl(REPORT_FD_IN_INIT, F_SETFD, FD_CLOEXEC);
    if (proxy_port && hand_over_proxy(proxy_port, proxy_fd) < 0)
        return 127;
    if (sys_close_range(REPORT_FD_IN_INIT + 1, ~0U) < 0) {
        dprintf(REPORT_FD_IN_INIT, "close_range: %s", strerror(errno));
        return 127;
    }
    /* Before the fork: no guest may ever see this process dumpable. The
     * command's execve makes the command itself dumpable again. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) {
        dprintf(REPORT_FD_IN_INIT, "dumpable: cannot make the init non-dumpable: %s", strerror(errno));
        return 127;
    }
    /* Children must become zombies for waitpid to see their status. */
    signal(SIGCHLD, SIG_DFL);
    command = fork();
    if (command < 0) {
        dprintf(REPORT_FD_IN_INIT, "fork: cannot start the command: %s", strerror(errno));
        return 127;
    }
    if (command == 0)
        run_command(limits, argv + 6);
    /* Nothing of the command's stays open here. */
    sys_close_range(0, ~0U);
    for (;;) {
        pid_t reaped = waitpid(-1, &status, 0);

        if (reaped == command)
            return exit_status_of(status);
        if (reaped < 0 && errno != EINTR)
            return 255; /* ECHILD: cannot happen while the command is ours to reap */
    }
}
