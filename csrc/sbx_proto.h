/* Wire protocol between the Python host and the sandbox holder.
 *
 * This header is the single definition of the messages: the holder includes
 * it, and the cffi module declares the same structs with "..." so Python takes
 * their layout from the compiler instead of repeating it.
 *
 * Control socket (SOCK_SEQPACKET, one per session):
 *   host -> holder   one struct sbx_exec_request followed by strings_len bytes
 *                    of NUL-terminated strings (cwd, argv[0..argc), env[0..envc)),
 *                    with SBX_NFDS descriptors attached by SCM_RIGHTS; or, of
 *                    kind SBX_REQUEST_RESTACK, two names (see below) and
 *                    one descriptor, the reply socket, on which the holder
 *                    answers READY with a new O_PATH fd of /workspace, or
 *                    ERROR: at step "restack" nothing changed (err
 *                    EOPNOTSUPP: this holder cannot restack at all), at
 *                    "restack-swap" /workspace is no longer to be trusted.
 *   holder -> host   STARTED (from the launcher, with the holder's pid as the
 *                    host sees it), then READY once setup is done, carrying
 *                    an O_PATH fd of /workspace by SCM_RIGHTS, and with
 *                    --proxy-port the session's proxy listeners after it
 *                    (127.0.0.1, then [::1] where the namespace has IPv6);
 *                    or ERROR.
 *
 * Command socket (SOCK_SEQPACKET, one per command, passed as SBX_FD_REPLY):
 *   holder/init -> host   ERROR (a setup step failed) and then EXITED, once the
 *                         command and every descendant are gone.
 *   host -> holder        struct sbx_signal_request; closing the socket kills
 *                         the command's whole tree.
 */
#ifndef SBX_PROTO_H
#define SBX_PROTO_H

#include <stdint.h>

#define SBX_PROTO_VERSION 4

/* The host hands the holder its end of the control socket as this fd, and
 * optionally the session's lease file as the next (see holder.c). */
#define SBX_HOLDER_CONTROL_FD 3
#define SBX_HOLDER_LEASE_FD 4
/* Upper bound on the strings of one request (cwd + argv + env). */
#define SBX_MAX_REQUEST_STRINGS (128 * 1024)

/* Each command's /tmp and /dev/shm are tmpfs of at most this many bytes
 * (memory, shared by everything on the host): a guest that fills them gets
 * ENOSPC instead of eating the host's RAM. /tmp's size is a session option
 * (--tmp-bytes); this is its default. */
#define SBX_TMP_BYTES (256ull << 20)
#define SBX_SHM_BYTES (64ull << 20)

/* The resource limits each request carries, in this order; a value of
 * SBX_RLIMIT_INHERIT leaves the limit as the holder has it (the host's). */
enum sbx_rlimit_index {
    SBX_RLIMIT_CPU = 0,    /* RLIMIT_CPU, seconds */
    SBX_RLIMIT_AS = 1,     /* RLIMIT_AS, bytes */
    SBX_RLIMIT_FSIZE = 2,  /* RLIMIT_FSIZE, bytes */
    SBX_RLIMIT_NOFILE = 3, /* RLIMIT_NOFILE */
    SBX_RLIMIT_NPROC = 4,  /* RLIMIT_NPROC */
    SBX_NRLIMITS = 5,
};
#define SBX_RLIMIT_INHERIT UINT64_MAX

enum sbx_request_fd {
    SBX_FD_REPLY = 0,
    SBX_FD_STDIN = 1,
    SBX_FD_STDOUT = 2,
    SBX_FD_STDERR = 3,
    SBX_NFDS = 4,
};

/* A restack request names, in the directory that holds the workspace's
 * upper layer (its "tree"), a new upper and work directory: the holder
 * mounts a new overlay over /workspace with them, whose topmost read-only
 * layer is the current upper directory, for a snapshot (see overlay.c). */
enum sbx_request_kind {
    SBX_REQUEST_EXEC = 1,
    SBX_REQUEST_RESTACK = 2,
    /* Like RESTACK, but the new overlay's read-only layers are named in the
     * layer stores the holder was started with (--template-store,
     * --snapshot-store): a new upper and work directory, then each layer as
     * "t/<template key>" or "s/<snapshot id>", topmost first. */
    SBX_REQUEST_REPLACE = 3,
};

struct sbx_exec_request {
    uint32_t version;
    uint32_t kind; /* enum sbx_request_kind */
    uint32_t argc;
    uint32_t envc;
    uint32_t strings_len;
    uint64_t rlimits[SBX_NRLIMITS]; /* enum sbx_rlimit_index */
};

/* The most fds one message carries: a request's, or READY's. */
#define SBX_MAX_PASSED_FDS SBX_NFDS

enum sbx_report_kind {
    SBX_REPORT_READY = 1,
    SBX_REPORT_ERROR = 2,
    SBX_REPORT_EXITED = 3,
    SBX_REPORT_STARTED = 4,
};

struct sbx_report {
    uint32_t kind;
    int32_t exit_code; /* EXITED: the exit code, or -1 when killed by a signal */
    int32_t signal;    /* EXITED: the terminating signal, or 0 */
    int32_t err;       /* ERROR: errno of the failed step */
    int32_t pid;       /* STARTED: pid 1 of the session, in the host's pid namespace */
    char step[32];     /* ERROR: which setup step failed */
    char message[224]; /* ERROR: human-readable detail */
};

struct sbx_signal_request {
    int32_t signal;
};

#endif
