/* Structured reports to the host. A setup step that fails says which step,
 * the errno and a message; the host never has to guess from an exit code. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "holder.h"

int fail(struct sbx_report *report, const char *step, int err, const char *fmt, ...)
{
    va_list ap;

    memset(report, 0, sizeof *report);
    report->kind = SBX_REPORT_ERROR;
    report->err = err;
    snprintf(report->step, sizeof report->step, "%s", step);
    va_start(ap, fmt);
    vsnprintf(report->message, sizeof report->message, fmt, ap);
    va_end(ap);
    return -1;
}

void report_send(int fd, const struct sbx_report *report)
{
    /* Best effort: the host may already have gone away (then it no longer
     * cares), and MSG_NOSIGNAL keeps a closed peer from killing us. */
    while (send(fd, report, sizeof *report, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

/* READY carries the holder's own handle on /workspace, so host-side file I/O
 * sees exactly the tree the guest sees (with an overlay, the merged view
 * exists only inside the session's mount namespace). */
void report_send_with_fds(int fd, const struct sbx_report *report, const int *fds, int nfds)
{
    send_with_fds(fd, report, sizeof *report, fds, nfds); /* best effort, as report_send */
}

void report_exit_status(int fd, int wait_status)
{
    struct sbx_report report = {.kind = SBX_REPORT_EXITED};

    if (WIFSIGNALED(wait_status)) {
        report.exit_code = -1;
        report.signal = WTERMSIG(wait_status);
    } else {
        report.exit_code = WEXITSTATUS(wait_status);
    }
    report_send(fd, &report);
}
