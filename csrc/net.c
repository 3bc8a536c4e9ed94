/* The session's own network namespace starts with a down loopback only. */
#define _GNU_SOURCE
#include <errno.h>
#include <net/if.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "holder.h"

int net_loopback_up(struct sbx_report *err)
{
    struct ifreq ifr;
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);

    if (sock < 0)
        return fail(err, "loopback", errno, "cannot open a socket: %s", strerror(errno));
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (ioctl(sock, SIOCGIFFLAGS, &ifr) < 0)
        goto fail;
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(sock, SIOCSIFFLAGS, &ifr) < 0)
        goto fail;
    close(sock);
    return 0;
fail:
    fail(err, "loopback", errno, "cannot bring lo up: %s", strerror(errno));
    close(sock);
    return -1;
}
