/* sandboxns-holder --in-cgroup FD -- PROGRAM [ARG...]
 *
 * Join the cgroup whose cgroup.procs is open as FD, then exec PROGRAM: how
 * the bwrap driver starts each bwrap of a session with a cgroup, so bwrap
 * and everything under it are in the session's cgroup before bwrap's first
 * fork (moving bwrap's pid from the host afterwards would race with it). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "holder.h"

int cgroup_exec_main(int argc, char **argv)
{
    int procs_fd;

    if (argc < 5 || strcmp(argv[3], "--") != 0 || (procs_fd = atoi(argv[2])) <= 2) {
        fprintf(stderr, "usage: sandboxns-holder --in-cgroup FD -- PROGRAM [ARG...]\n");
        return 127;
    }
    if (write(procs_fd, "0", 1) != 1) {
        fprintf(stderr, "sandboxns-holder: cannot join the session's cgroup: %s\n", strerror(errno));
        return 127;
    }
    close(procs_fd);
    execv(argv[4], argv + 4);
    fprintf(stderr, "sandboxns-holder: cannot execute %s: %s\n", argv[4], strerror(errno));
    return 127;
}
