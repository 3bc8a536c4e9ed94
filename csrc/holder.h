/* Internal interfaces of the sandbox holder program (not the cffi module). */
#ifndef SBX_HOLDER_H
#define SBX_HOLDER_H

#include <stdarg.h>
#include <sys/types.h>

#include "sbx_proto.h"
#include "sbx_seccomp.h"
#include "syscalls.h"

/* Mount attributes of the guest's trees: system ones, and writable ones. */
#define RUNTIME_RO (MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
#define WORKSPACE_ATTRS (MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)

/* The fds the host hands the holder (sbx_proto.h). */
#define CONTROL_FD SBX_HOLDER_CONTROL_FD
#define LEASE_FD SBX_HOLDER_LEASE_FD

/* An extra host tree bound into the guest (--bind=ro|rw:GUEST:HOST). */
#define MAX_EXTRA_BINDS 8
struct extra_bind {
    const char *guest; /* absolute guest path */
    const char *host;
    int writable;
    int tree_fd; /* prepared clone of host (a root host's, see idmap.c), or -1 */
};

/* The most read-only layers an overlay workspace stacks: a template and the
 * snapshots taken above it. The host flattens a deeper stack into one layer
 * (sandboxns/_snapshots.py), as each layer costs every lookup that misses
 * the ones above it. */
#define MAX_OVERLAY_LOWERS 32

/* The host trees a root host clones before it gives up root (userns.c,
 * userns_prepare_host_ids); -1 where nothing was prepared. */
/* The state directory's stores of read-only layers a session started ahead
 * (for forks) may later stand on: --template-store, --snapshot-store. */
enum layer_store { STORE_TEMPLATES = 0, STORE_SNAPSHOTS = 1, NSTORES = 2 };

struct prepared_trees {
    int workspace;    /* the workspace, without an overlay */
    int overlay_tree; /* the directory holding the overlay's upper and work dirs */
    int overlay_lowers[MAX_OVERLAY_LOWERS]; /* the overlay's read-only layers */
    int stores[NSTORES];
    int gateway_dir;
    int image_root;
};

/* An overlay workspace's layers as the holder keeps them (overlay.c): fds of
 * detached mounts, so that it can mount a new overlay over /workspace later
 * (restack) without the host's tree. */
struct overlay_stack {
    int tree;                          /* the directory of the upper and work directories, or -1 */
    int upper;                         /* the upper directory, or -1 */
    int lowers[MAX_OVERLAY_LOWERS];    /* topmost first */
    int nlowers;
    int stores[NSTORES];               /* enum layer_store, or -1 */
    int restackable;                   /* mounted from these fds, and nothing is mounted inside it */
};

/* One part of the guests' seccomp filter (enum sbx_seccomp_part), compiled. */
struct seccomp_part {
    struct sock_filter insns[SBX_SECCOMP_MAX_INSNS];
    unsigned short len;
};

/* What every command of the session gets, fixed when the holder starts. */
struct command_settings {
    unsigned long long tmp_bytes; /* size of each command's /tmp */
    struct seccomp_part seccomp;  /* the command part, which each init installs */
    int reuse_inits;              /* whether an init may serve another command (see serve.c) */
};

struct holder_config {
    uid_t inner_uid, outer_uid;
    gid_t inner_gid, outer_gid;
    const char *workspace;     /* bound as /workspace; the upper layer with an overlay */
    const char *overlay_lowers[MAX_OVERLAY_LOWERS]; /* read-only layers under the workspace, topmost first */
    int noverlay_lowers;
    const char *overlay_work;  /* overlayfs's scratch directory, beside the upper */
    const char *stores[NSTORES]; /* enum layer_store: where later layers come from, or NULL */
    const char *gateway_dir;    /* host path of the egress gateway's directory, or NULL */
    const char *image_root;     /* --image-root: the guest's / is this tree, not the host's, or NULL */
    unsigned int proxy_port;    /* --proxy-port: listen for the gateway's proxy there, or 0 */
    const char *hostname;
    int share_network;
    struct extra_bind extra_binds[MAX_EXTRA_BINDS]; /* in order: later ones may lie inside earlier ones */
    int nextra_binds;
    int host_ids;              /* --host-ids: a root host maps the guest to outer_uid/gid below */
    struct prepared_trees prepared;
    uint32_t seccomp_relaxed; /* --seccomp-relax: groups lifted */
    uint32_t seccomp_denied[SBX_SECCOMP_MAX_EXTRA]; /* --seccomp-deny: more syscalls denied */
    size_t nseccomp_denied;
    struct seccomp_part session_seccomp; /* the holder's own, installed before it serves */
    struct command_settings commands;
};

/* filter.c */
int compile_seccomp(struct holder_config *cfg, struct sbx_report *err);
int seccomp_install(const struct seccomp_part *part, struct sbx_report *err);

/* report.c: structured errors, in the spirit of crun's sync socket. */
int fail(struct sbx_report *report, const char *step, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void report_send(int fd, const struct sbx_report *report);
void report_send_with_fds(int fd, const struct sbx_report *report, const int *fds, int nfds);
void report_exit_status(int fd, int wait_status);

/* fds.c */
int close_fds_except(const int *keep, int nkeep);
ssize_t receive_request(int fd, char *buf, size_t size, int fds[SBX_NFDS], int *nfds, int flags);
int send_with_fds(int fd, const void *buf, size_t len, const int *fds, int nfds);

/* userns.c */
int userns_prepare_host_ids(struct holder_config *cfg, struct sbx_report *err);
int userns_enter(const struct holder_config *cfg, struct sbx_report *err);
int userns_forbid_nesting(struct sbx_report *err);
int userns_empty_bounding_set(struct sbx_report *err);

/* rootfs.c */
int rootfs_build(const struct holder_config *cfg, struct overlay_stack *stack, struct sbx_report *err);

/* overlay.c */
void overlay_stack_init(struct overlay_stack *stack);
void overlay_stack_release(struct overlay_stack *stack);
/* Sets what every workspace overlay is mounted with on an fsopen() fd. */
int overlay_set_options(int fs);
/* A detached overlay mount of the stack's layers under the upper and work
 * directories named in its tree, whose upper directory the stack keeps; -1
 * with errno set (before Linux 6.13 the kernel takes no layer by fd). */
int overlay_mount_stack(struct overlay_stack *stack, const char *upper_name, const char *work_name);
/* A new overlay over /workspace whose topmost read-only layer is the
 * current upper directory, wherever the host has renamed it to since, for
 * a snapshot. */
int overlay_restack(struct overlay_stack *stack, const char *upper_name, const char *work_name, int *workspace_fd,
                    struct sbx_report *err);
/* A new overlay over /workspace on other layers of the stores, each named
 * "t/<template key>" or "s/<snapshot id>" (topmost first), for a fork. */
int overlay_replace(struct overlay_stack *stack, const char *upper_name, const char *work_name,
                    const char *const *layers, int nlayers, int *workspace_fd, struct sbx_report *err);

/* net.c */
int net_loopback_up(struct sbx_report *err);
int net_proxy_listen(unsigned int port, int fds[2], struct sbx_report *err);

/* spawn.c */
struct exec_plan {
    const char *cwd;
    char **argv;
    char **envp;
    int fds[SBX_NFDS];
    uint64_t rlimits[SBX_NRLIMITS];
};

/* What an init tells the holder on its request socket (see spawn.c): its
 * command's tree is gone and reported; it is ready for the next request. */
#define INIT_DONE 'd'
#define INIT_READY 'r'
pid_t spawn_idle_init(const struct command_settings *settings, int *pidfd, int *request_fd,
                      struct sbx_report *err);

/* serve.c */
int holder_serve(int control_fd, const struct command_settings *settings, struct overlay_stack *stack);

/* limits.c */
int limits_apply(const uint64_t values[SBX_NRLIMITS], struct sbx_report *err);

/* bwrap_init.c */
int bwrap_init_main(int argc, char **argv);

/* enter.c */
int enter_main(int argc, char **argv);

#endif
