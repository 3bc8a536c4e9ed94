/* The guests' seccomp filter on the holder's side: the session's two parts
 * compiled once from the table in seccomp.c (which the cffi module shares),
 * and installed, the session part by the holder and the command part by
 * each init. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <string.h>
#include <sys/prctl.h>

#include "holder.h"

static int compile_seccomp_part(const struct holder_config *cfg, enum sbx_seccomp_part part,
                                struct seccomp_part *out, struct sbx_report *err)
{
    struct sbx_seccomp_options options = {.part = part,
                                          .relaxed = cfg->seccomp_relaxed,
                                          .extra_denied = cfg->seccomp_denied,
                                          .nextra_denied = cfg->nseccomp_denied};
    size_t len = sbx_seccomp_program(out->insns, SBX_SECCOMP_MAX_INSNS, &options);

    if (len == 0)
        return fail(err, "seccomp", E2BIG, "the seccomp program does not fit");
    out->len = (unsigned short)len;
    return 0;
}

/* The session's filter, in its two parts, compiled once. */
int compile_seccomp(struct holder_config *cfg, struct sbx_report *err)
{
    if (compile_seccomp_part(cfg, SBX_SECCOMP_SESSION_PART, &cfg->session_seccomp, err) < 0)
        return -1;
    return compile_seccomp_part(cfg, SBX_SECCOMP_COMMAND_PART, &cfg->commands.seccomp, err);
}

/* The holder and each init hold CAP_SYS_ADMIN in the session's user
 * namespace, which lets them install a filter without no_new_privs (every
 * command sets that itself before its execve). */
int seccomp_install(const struct seccomp_part *part, struct sbx_report *err)
{
    struct sock_fprog program = {.len = part->len, .filter = (struct sock_filter *)part->insns};

    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) < 0)
        return fail(err, "seccomp", errno, "cannot install the seccomp filter: %s", strerror(errno));
    return 0;
}
