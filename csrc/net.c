/* The session's own network namespace starts with a down loopback only. */
#define _GNU_SOURCE
#include <errno.h>
#include <net/if.h>
#include <netinet/in.h>
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

/* The session's HTTP proxy endpoint: listening TCP sockets on 127.0.0.1:port
 * and [::1]:port in this network namespace, made here and handed to the host,
 * whose gateway accepts on them. A socket keeps the namespace it was made in
 * however far it travels, so the host serves guests' connections without
 * ever entering the namespace. IPv6 is optional (a namespace may not have
 * it). Returns how many listeners fds holds (1 or 2). */
static int listen_on(int family, const void *address, socklen_t length, struct sbx_report *err)
{
    int one = 1;
    int sock = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);

    if (sock < 0)
        return fail(err, "proxy", errno, "cannot open the proxy's socket: %s", strerror(errno));
    if ((family == AF_INET6 && setsockopt(sock, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) < 0) ||
        bind(sock, address, length) < 0 || listen(sock, SOMAXCONN) < 0) {
        fail(err, "proxy", errno, "cannot listen for the proxy: %s", strerror(errno));
        close(sock);
        return -1;
    }
    return sock;
}

int net_proxy_listen(unsigned int port, int fds[2], struct sbx_report *err)
{
    struct sockaddr_in v4 = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct sockaddr_in6 v6 = {.sin6_family = AF_INET6, .sin6_port = htons(port), .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    struct sbx_report ignored;

    fds[0] = listen_on(AF_INET, &v4, sizeof v4, err);
    if (fds[0] < 0)
        return -1;
    fds[1] = listen_on(AF_INET6, &v6, sizeof v6, &ignored);
    return fds[1] < 0 ? 1 : 2;
}
