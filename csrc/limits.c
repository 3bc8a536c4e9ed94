/* Per-command resource limits, set in the command process before its execve
 * (native driver) or by `sandboxns-holder --exec` inside bwrap's sandbox.
 *
 * Soft and hard limits are both set: a guest may lower them further but never
 * raise them again. Raising a hard limit needs CAP_SYS_RESOURCE in the host's
 * user namespace, which no sandbox process has, so a limit above the host's
 * own fails here (the host refuses such values before asking). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

/* Where `--exec` keeps its report channel: right above stdio. */
#define REPORT_FD_IN_EXEC 3

static const struct {
    int resource;
    const char *name;
} resources[SBX_NRLIMITS] = {
    [SBX_RLIMIT_CPU] = {RLIMIT_CPU, "cpu"},          [SBX_RLIMIT_AS] = {RLIMIT_AS, "address space"},
    [SBX_RLIMIT_FSIZE] = {RLIMIT_FSIZE, "file size"}, [SBX_RLIMIT_NOFILE] = {RLIMIT_NOFILE, "open files"},
    [SBX_RLIMIT_NPROC] = {RLIMIT_NPROC, "processes"},
};

int limits_apply(const uint64_t values[SBX_NRLIMITS], struct sbx_report *err)
{
    for (int i = 0; i < SBX_NRLIMITS; i++) {
        struct rlimit limit = {.rlim_cur = values[i], .rlim_max = values[i]};

        if (values[i] == SBX_RLIMIT_INHERIT)
            continue;
        if (setrlimit(resources[i].resource, &limit) < 0)
            return fail(err, "rlimits", errno, "cannot limit %s to %llu: %s", resources[i].name,
                        (unsigned long long)values[i], strerror(errno));
    }
    return 0;
}

/* sandboxns-holder --exec REPORT_FD LIMITS -- COMMAND [ARG...]
 *
 * The bwrap driver's command line inside bwrap's sandbox: set LIMITS (the
 * SBX_NRLIMITS values of enum sbx_rlimit_index, comma-separated, "-" to
 * inherit), close every inherited fd but stdio, and exec COMMAND from PATH.
 * bwrap knows nothing of rlimits, and setting them on bwrap itself would
 * count the host user's processes against RLIMIT_NPROC at bwrap's clone;
 * here they count only the command's. A failure is written to REPORT_FD in
 * bwrap's own words ("execvp NAME: reason"), so the host tells it from the
 * command's exit code; a successful exec closes REPORT_FD (close-on-exec). */
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

int limits_exec_main(int argc, char **argv)
{
    uint64_t values[SBX_NRLIMITS];
    struct sbx_report err;
    int report_fd;

    if (argc < 6 || strcmp(argv[4], "--") != 0 || parse_limits(argv[3], values) < 0 ||
        (report_fd = atoi(argv[2])) <= 2) {
        fprintf(stderr, "usage: sandboxns-holder --exec REPORT_FD LIMITS -- COMMAND [ARG...]\n");
        return 127;
    }
    if (dup3(report_fd, REPORT_FD_IN_EXEC, O_CLOEXEC) < 0 && report_fd != REPORT_FD_IN_EXEC) {
        fprintf(stderr, "sandboxns-holder --exec: bad report fd: %s\n", strerror(errno));
        return 127;
    }
    fcntl(REPORT_FD_IN_EXEC, F_SETFD, FD_CLOEXEC);
    if (sys_close_range(REPORT_FD_IN_EXEC + 1, ~0U) < 0)
        dprintf(REPORT_FD_IN_EXEC, "close_range: %s", strerror(errno));
    else if (limits_apply(values, &err) < 0)
        dprintf(REPORT_FD_IN_EXEC, "%s: %s", err.step, err.message);
    else {
        execvp(argv[5], argv + 5);
        dprintf(REPORT_FD_IN_EXEC, "execvp %s: %s", argv[5], strerror(errno));
    }
    return 127;
}
