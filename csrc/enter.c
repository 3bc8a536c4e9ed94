/* sandboxns-holder --enter [--cgroup-procs=FD] [--mount-ns=FD] [--user=UID:GID] -- PROGRAM [ARG...]
 *
 * How the bwrap driver starts each bwrap where its session lives, then
 * execs it:
 *   --cgroup-procs=FD  join the session's cgroup (FD is its cgroup.procs),
 *                      so bwrap and everything under it are in the cgroup
 *                      before bwrap's first fork (moving bwrap's pid from
 *                      the host afterwards would race with it);
 *   --mount-ns=FD      enter the mount namespace a root host prepared, in
 *                      which the workspace shows its owner's files as the
 *                      guest's (see idmap.c);
 *   --user=UID:GID     then become that unprivileged user for good (a root
 *                      host's guests' host user), who owns the user
 *                      namespace bwrap is given. */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "holder.h"

static int parse_fd(const char *text)
{
    char *end;
    long fd = strtol(text, &end, 10);

    return *end || end == text || fd <= 2 || fd > 65535 ? -1 : (int)fd;
}

int enter_main(int argc, char **argv)
{
    int cgroup_procs = -1, mount_ns = -1, i;
    unsigned int uid = 0, gid = 0;

    for (i = 2; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strncmp(argv[i], "--cgroup-procs=", 15) == 0 && (cgroup_procs = parse_fd(argv[i] + 15)) >= 0)
            continue;
        if (strncmp(argv[i], "--mount-ns=", 11) == 0 && (mount_ns = parse_fd(argv[i] + 11)) >= 0)
            continue;
        if (sscanf(argv[i], "--user=%u:%u", &uid, &gid) == 2 && uid != 0 && gid != 0)
            continue;
        break;
    }
    if (i + 1 >= argc || strcmp(argv[i], "--") != 0) {
        fprintf(stderr, "usage: sandboxns-holder --enter [--cgroup-procs=FD] [--mount-ns=FD] [--user=UID:GID] -- "
                        "PROGRAM [ARG...]\n");
        return 127;
    }
    if (cgroup_procs >= 0 && write(cgroup_procs, "0", 1) != 1) {
        fprintf(stderr, "sandboxns-holder: cannot join the session's cgroup: %s\n", strerror(errno));
        return 127;
    }
    if (mount_ns >= 0 && setns(mount_ns, CLONE_NEWNS) < 0) {
        fprintf(stderr, "sandboxns-holder: cannot enter the session's mount namespace: %s\n", strerror(errno));
        return 127;
    }
    if (uid != 0 && (setgroups(0, NULL) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)) {
        fprintf(stderr, "sandboxns-holder: cannot become uid %u: %s\n", uid, strerror(errno));
        return 127;
    }
    if (cgroup_procs >= 0)
        close(cgroup_procs);
    if (mount_ns >= 0)
        close(mount_ns);
    execv(argv[i + 1], argv + i + 1);
    fprintf(stderr, "sandboxns-holder: cannot execute %s: %s\n", argv[i + 1], strerror(errno));
    return 127;
}
