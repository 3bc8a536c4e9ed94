/* sandboxns-holder --init REPORT_FD LIMITS -- COMMAND [ARG...]
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

int bwrap_init_main(int argc, char **argv)
{
    uint64_t limits[SBX_NRLIMITS];
    int report_fd, status;
    pid_t command;

    if (argc < 6 || strcmp(argv[4], "--") != 0 || parse_limits(argv[3], limits) < 0 ||
        (report_fd = atoi(argv[2])) <= 2) {
        fprintf(stderr, "usage: sandboxns-holder --init REPORT_FD LIMITS -- COMMAND [ARG...]\n");
        return 127;
    }
    if (dup3(report_fd, REPORT_FD_IN_INIT, O_CLOEXEC) < 0 && report_fd != REPORT_FD_IN_INIT) {
        fprintf(stderr, "sandboxns-holder --init: bad report fd: %s\n", strerror(errno));
        return 127;
    }
    fcntl(REPORT_FD_IN_INIT, F_SETFD, FD_CLOEXEC);
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
        run_command(limits, argv + 5);
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
