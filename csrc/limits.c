/* Per-command resource limits, set in the command process before its execve
 * (native driver) or by `sandboxns-holder --init` inside bwrap's sandbox.
 *
 * Soft and hard limits are both set: a guest may lower them further but never
 * raise them again. Raising a hard limit needs CAP_SYS_RESOURCE in the host's
 * user namespace, which no sandbox process has, so a limit above the host's
 * own fails here (the host refuses such values before asking). */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/resource.h>

#include "holder.h"

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
