/* The holder's request loop: one epoll set over the control socket and, per
 * init, its pidfd, its request socket and (while it runs a command) the
 * command's reply socket.
 *
 * An init is always ready ahead (see spawn.c). A request is forwarded to an
 * idle one as received, fds and all; the holder keeps the reply socket to
 * forward signal requests, to notice the host giving up on the command (the
 * socket closes), and to report for an init that died before it did. An init
 * says on its request socket when its command's tree is gone, just before
 * it reports (INIT_DONE: from then on the host closing its socket is no
 * reason to kill it), and when it has put its namespaces back for another
 * command (INIT_READY: the holder lets go of the socket). An init the holder
 * kills never serves again.
 *
 * Which init may serve a request. One that has run a command is reused only
 * when no other command of the session runs: a process of a command that
 * ran beside its last one could have been handed a hold on its namespaces
 * (a /proc or /tmp directory fd passed over a socket, a signal owner), and
 * would see, signal or change the next command in them; once every command
 * has ended, every such process is gone. Otherwise a fresh init serves, one
 * that has never run anything. Never with the host's network shared
 * (command_settings.reuse_inits): there, processes outside the session can
 * be handed such holds. Up to MAX_USED_INITS used ones wait; one more, or
 * one made before the workspace was restacked, is killed instead. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "holder.h"
#include "syscalls.h"

enum watch_kind { WATCH_CONTROL, WATCH_REPLY, WATCH_INIT, WATCH_REQUEST };

/* Sequential commands need one; more wait for a quiet moment in vain. */
#define MAX_USED_INITS 2

struct init;

struct watch {
    enum watch_kind kind;
    struct init *init;
};

/* Idle inits of one kind, the last in first out. */
struct pool {
    struct init *top;
    int count;
};

struct init {
    pid_t pid;
    int pidfd;
    int request_fd; /* holder's end of the init's request socket */
    int reply_fd;   /* the command's reply socket; -1 while idle or once done */
    int busy;       /* from its request to its INIT_READY */
    int done;       /* its command said INIT_DONE */
    int doomed;     /* sent SIGKILL: it only waits to be reaped */
    unsigned generation; /* of the workspace's stack it was made over */
    struct watch reply_watch, pid_watch, request_watch;
    struct init *next;      /* in inits */
    struct init *next_idle; /* in its pool, while it is in one */
    struct pool *pool;
};

static struct init *inits; /* every init not yet reaped */
static struct pool fresh;  /* never ran a command */
static struct pool used;   /* ran one, and put its namespaces back */
static int nbusy;
static unsigned generation; /* bumped when /workspace is restacked */
static int epoll_fd = -1;
static const struct command_settings *settings;
static struct overlay_stack *workspace_stack;

static int watch_fd(int fd, struct watch *watch)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = watch};
    return epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
}

static void close_fds(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

static void push_idle(struct pool *pool, struct init *init)
{
    init->next_idle = pool->top;
    init->pool = pool;
    pool->top = init;
    pool->count++;
}

static struct init *pop_idle(struct pool *pool)
{
    struct init *init = pool->top;

    if (init) {
        pool->top = init->next_idle;
        init->pool = NULL;
        pool->count--;
    }
    return init;
}

static void remove_idle(struct init *init)
{
    struct init **link;

    if (!init->pool)
        return;
    for (link = &init->pool->top; *link != init; link = &(*link)->next_idle)
        ;
    *link = init->next_idle;
    init->pool->count--;
    init->pool = NULL;
}

static void kill_init(struct init *init)
{
    init->doomed = 1;
    remove_idle(init);
    sys_pidfd_send_signal(init->pidfd, SIGKILL); /* reaped as any other */
}

static void set_busy(struct init *init, int busy)
{
    nbusy += busy - init->busy;
    init->busy = busy;
}

/* Idle inits see the workspace as it was when they were made: after a
 * restack, they go (each is reaped as any other), and so will the busy
 * ones when they are done. */
static void retire_inits(void)
{
    struct init *init;

    generation++;
    while ((init = fresh.top ? fresh.top : used.top))
        kill_init(init);
}

static int prepare_init(struct sbx_report *err)
{
    struct init *init = calloc(1, sizeof *init);

    if (!init)
        return fail(err, "prepare", ENOMEM, "out of memory");
    init->pid = spawn_idle_init(settings, &init->pidfd, &init->request_fd, err);
    if (init->pid < 0) {
        free(init);
        return -1;
    }
    init->reply_fd = -1;
    init->generation = generation;
    init->pid_watch = (struct watch){WATCH_INIT, init};
    init->reply_watch = (struct watch){WATCH_REPLY, init};
    init->request_watch = (struct watch){WATCH_REQUEST, init};
    if (watch_fd(init->pidfd, &init->pid_watch) < 0 || watch_fd(init->request_fd, &init->request_watch) < 0) {
        int e = errno;
        /* Unwatched, it could never be reaped: don't let it exist. */
        sys_pidfd_send_signal(init->pidfd, SIGKILL);
        waitpid(init->pid, NULL, 0);
        close(init->pidfd);
        close(init->request_fd);
        free(init);
        return fail(err, "prepare", e, "cannot watch the command's init");
    }
    init->next = inits;
    inits = init;
    push_idle(&fresh, init);
    return 0;
}

/* A snapshot's new overlay over /workspace (see overlay.c). The prepared
 * init made its mount namespace as a copy of the holder's: it would show
 * the old overlay, so it goes, and the next is made over the new one. */
static void restack(const char *buf, size_t len, int reply_fd)
{
    struct sbx_exec_request req;
    struct sbx_report err;
    const char *names[2 + MAX_OVERLAY_LOWERS], *strings = buf + sizeof req, *end = buf + len;
    int workspace_fd, rc;

    memcpy(&req, buf, sizeof req);
    if (req.version != SBX_PROTO_VERSION || req.argc < 2 || req.argc > 2 + MAX_OVERLAY_LOWERS ||
        (req.kind == SBX_REQUEST_RESTACK && req.argc != 2) || req.envc != 0 || req.strings_len == 0 ||
        req.strings_len != len - sizeof req || end[-1] != '\0') {
        fail(&err, "restack", EINVAL, "malformed restack request");
        goto refuse;
    }
    for (uint32_t i = 0; i < req.argc; i++) {
        if (strings >= end) {
            fail(&err, "restack", EINVAL, "malformed restack request");
            goto refuse;
        }
        names[i] = strings;
        strings += strlen(strings) + 1;
    }
    if (req.kind == SBX_REQUEST_RESTACK)
        rc = overlay_restack(workspace_stack, names[0], names[1], &workspace_fd, &err);
    else
        rc = overlay_replace(workspace_stack, names[0], names[1], names + 2, (int)req.argc - 2, &workspace_fd, &err);
    if (rc < 0)
        goto refuse;
    retire_inits();
    report_send_with_fds(reply_fd, &(struct sbx_report){.kind = SBX_REPORT_READY}, &workspace_fd, 1);
    close(workspace_fd);
    close(reply_fd);
    prepare_init(&err); /* as after a command: a failure is the next request's */
    return;
refuse:
    /* A failed swap leaves /workspace unknown: no init of the old one either. */
    if (strcmp(err.step, "restack-swap") == 0)
        retire_inits();
    report_send(reply_fd, &err);
    close(reply_fd);
}

/* The init to serve a request (see the top), or NULL with err set. */
static struct init *take_init(struct sbx_report *err)
{
    struct init *init = nbusy == 0 ? pop_idle(&used) : NULL;

    if (!init && !fresh.top && prepare_init(err) < 0)
        return NULL;
    return init ? init : pop_idle(&fresh);
}

static void dispatch(const char *buf, size_t len, int fds[SBX_NFDS])
{
    struct sbx_report err;
    struct init *init;

    /* An idle init that died is not reaped yet: another takes the request. */
    for (int attempt = 0;; attempt++) {
        if (!(init = take_init(&err)))
            goto refuse;
        if (send_with_fds(init->request_fd, buf, len, fds, SBX_NFDS) == 0)
            break;
        fail(&err, "dispatch", errno, "cannot hand the command to its init");
        kill_init(init);
        if (attempt == 1)
            goto refuse;
    }
    set_busy(init, 1);
    init->done = 0;
    /* The init has its own copies now; the holder keeps only the reply. */
    close_fds(fds + SBX_FD_STDIN, SBX_NFDS - SBX_FD_STDIN);
    init->reply_fd = fds[SBX_FD_REPLY];
    if (watch_fd(init->reply_fd, &init->reply_watch) < 0)
        kill_init(init); /* unmanageable: its reap reports */
    /* Get the next one ready while this command runs. A failure here is
     * retried, and reported, by the next request. */
    if (!fresh.top)
        prepare_init(&err);
    return;
refuse:
    report_send(fds[SBX_FD_REPLY], &err);
    close_fds(fds, SBX_NFDS);
}

/* Returns 0 to keep serving, 1 when the host has gone away. */
static int serve_control(int control_fd)
{
    static char buf[sizeof(struct sbx_exec_request) + SBX_MAX_REQUEST_STRINGS];
    struct sbx_exec_request req;
    int fds[SBX_NFDS], nfds;
    ssize_t len = receive_request(control_fd, buf, sizeof buf, fds, &nfds, MSG_DONTWAIT);

    if (len < 0)
        return errno == EAGAIN || errno == EBADMSG ? 0 : 1;
    if (len == 0)
        return 1;
    if ((size_t)len >= sizeof req) {
        memcpy(&req, buf, sizeof req);
        if ((req.kind == SBX_REQUEST_RESTACK || req.kind == SBX_REQUEST_REPLACE) && nfds == 1) {
            restack(buf, (size_t)len, fds[SBX_FD_REPLY]);
            return 0;
        }
    }
    if (nfds != SBX_NFDS) { /* nothing this holder asks for; the host's bug */
        close_fds(fds, nfds);
        return 0;
    }
    dispatch(buf, (size_t)len, fds);
    return 0;
}

static void stop_watching_reply(struct init *init)
{
    if (init->reply_fd < 0)
        return;
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, init->reply_fd, NULL);
    close(init->reply_fd);
    init->reply_fd = -1;
}

static void serve_reply(struct init *init)
{
    struct sbx_signal_request req;
    ssize_t n;

    /* An event of this batch for a command whose init said INIT_DONE
     * earlier in it: nothing to forward any more. */
    if (init->reply_fd < 0)
        return;
    while ((n = recv(init->reply_fd, &req, sizeof req, MSG_DONTWAIT)) == (ssize_t)sizeof req) {
        if (init->done)
            continue; /* its tree is gone already */
        if (req.signal == SIGKILL)
            kill_init(init);
        else
            sys_pidfd_send_signal(init->pidfd, req.signal);
    }
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        /* The host closed its end: nobody wants this command any more. */
        if (!init->done)
            kill_init(init);
        stop_watching_reply(init);
    }
}

/* What the init says of its command, and of itself (see the top). */
static void serve_request(struct init *init)
{
    char said;
    ssize_t n;

    /* One byte a message (SOCK_SEQPACKET): both, if both are there. */
    while ((n = recv(init->request_fd, &said, 1, MSG_DONTWAIT)) == 1) {
        if (said == INIT_DONE) {
            init->done = 1;
        } else if (said == INIT_READY && init->busy) {
            stop_watching_reply(init);
            set_busy(init, 0);
            if (init->doomed)
                continue;
            if (init->generation == generation && used.count < MAX_USED_INITS)
                push_idle(&used, init);
            else
                kill_init(init);
        }
    }
    /* Its end closed (it is exiting): the reap follows. */
    if (n == 0)
        epoll_ctl(epoll_fd, EPOLL_CTL_DEL, init->request_fd, NULL);
}

static void reap(struct init *init)
{
    struct init **link;
    int status;

    if (waitpid(init->pid, &status, WNOHANG) <= 0)
        return;
    serve_request(init); /* an INIT_DONE it sent before it died */
    /* A command whose init died before it was ready again: if it was
     * killed (timeout, cancellation, its limits), its pid namespace, and so
     * the whole tree, is gone now, so report that (the host reads no second
     * report, should it have sent one); if it ended on its own before its
     * command was done, it could not run it (having reported why, when it
     * exits 1). */
    if (init->reply_fd >= 0) {
        struct sbx_report err;

        if (!WIFEXITED(status)) {
            report_exit_status(init->reply_fd, status);
        } else if (!init->done && WEXITSTATUS(status) == 0) {
            fail(&err, "init", EPIPE, "the command's init ended before it could run the command");
            report_send(init->reply_fd, &err);
        }
    }
    set_busy(init, 0);
    for (link = &inits; *link != init; link = &(*link)->next)
        ;
    *link = init->next;
    remove_idle(init);
    /* Deregister before closing: a freshly cloned init may still hold a copy
     * of these fds, and epoll forgets an fd only when its last copy closes. */
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, init->pidfd, NULL);
    close(init->pidfd);
    stop_watching_reply(init);
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, init->request_fd, NULL);
    close(init->request_fd);
    free(init);
}

int holder_serve(int control_fd, const struct command_settings *command_settings, struct overlay_stack *stack)
{
    struct watch control_watch = {WATCH_CONTROL, NULL};
    struct epoll_event events[32];
    struct sbx_report ignored;

    settings = command_settings;
    workspace_stack = stack;
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd < 0 || watch_fd(control_fd, &control_watch) < 0)
        return 1;
    prepare_init(&ignored);
    for (;;) {
        int n = epoll_wait(epoll_fd, events, 32, -1);

        if (n < 0 && errno != EINTR)
            return 1;
        for (int i = 0; i < n; i++) {
            struct watch *watch = events[i].data.ptr;

            switch (watch->kind) {
            case WATCH_CONTROL:
                /* The host is gone (or stopped us): returning makes pid 1
                 * exit, and the kernel kills the rest of the session. */
                if (serve_control(control_fd))
                    return 0;
                break;
            case WATCH_REPLY:
                serve_reply(watch->init);
                break;
            case WATCH_REQUEST:
                serve_request(watch->init);
                break;
            case WATCH_INIT:
                reap(watch->init);
                /* Later events in this batch may name the freed init; epoll
                 * is level-triggered, so they come back on the next wait. */
                n = 0;
                break;
            }
        }
    }
}
