/* Descriptors: passing requests with their fds, and making sure nothing the
 * holder has open reaches a guest. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

static int compare_fds(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

/* Close every fd except those in keep (which is sorted in place). */
int close_fds_except(const int *keep, int nkeep)
{
    int sorted[SBX_NFDS + 2];
    unsigned int next = 0;

    if (nkeep > (int)(sizeof sorted / sizeof sorted[0]))
        return -EINVAL;
    for (int i = 0; i < nkeep; i++)
        sorted[i] = keep[i];
    qsort(sorted, (size_t)nkeep, sizeof sorted[0], compare_fds);
    for (int i = 0; i < nkeep; i++) {
        if (sorted[i] < 0 || (unsigned int)sorted[i] < next)
            continue;
        if ((unsigned int)sorted[i] > next && sys_close_range(next, (unsigned int)sorted[i] - 1) < 0)
            return -errno;
        next = (unsigned int)sorted[i] + 1;
    }
    if (sys_close_range(next, UINT_MAX) < 0)
        return -errno;
    return 0;
}

/* Receive one request message with its descriptors (close-on-exec), 1 to
 * SBX_NFDS of them, counted in *nfds_out: an exec request has SBX_NFDS, a
 * restack request its reply socket alone. Returns the message length, 0 at
 * EOF, or -1 with errno set. A message that arrives without one has nobody
 * to answer it: it is dropped (EBADMSG), its fds closed. */
ssize_t receive_request(int fd, char *buf, size_t size, int fds[SBX_NFDS], int *nfds_out, int flags)
{
    char control[CMSG_SPACE(sizeof(int) * SBX_NFDS)];
    struct iovec iov = {.iov_base = buf, .iov_len = size};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    int nfds = 0;
    ssize_t len;

    for (int i = 0; i < SBX_NFDS; i++)
        fds[i] = -1;
    do
        len = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | flags);
    while (len < 0 && errno == EINTR);
    if (len <= 0)
        return len;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            memcpy(fds, CMSG_DATA(c), sizeof(int) * (size_t)(nfds > SBX_NFDS ? SBX_NFDS : nfds));
        }
    }
    if (nfds < 1 || nfds > SBX_NFDS || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        for (int i = 0; i < SBX_NFDS; i++)
            if (fds[i] >= 0)
                close(fds[i]);
        errno = EBADMSG;
        return -1;
    }
    *nfds_out = nfds;
    return len;
}

/* Send one message with nfds (1 to SBX_MAX_PASSED_FDS) descriptors. */
int send_with_fds(int fd, const void *buf, size_t len, const int *fds, int nfds)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * SBX_MAX_PASSED_FDS)];
        struct cmsghdr align;
    } control = {0};
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = control.buf,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    ssize_t sent;

    if (nfds < 1 || nfds > SBX_MAX_PASSED_FDS) {
        errno = EINVAL;
        return -1;
    }
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    do
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    return sent < 0 ? -1 : 0;
}
