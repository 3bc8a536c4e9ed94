/* The host side of a session's workspace size cap (sandboxns/_image.py): its
 * ext4 image file attached to a loop device and mounted, in the host's mount
 * namespace, before the session's sandbox starts.
 *
 * The loop device is configured with LO_FLAGS_AUTOCLEAR: the kernel unbinds
 * it when its last opener closes it, which, once the file system is mounted,
 * is when the mount's last reference goes (our unmount, or the last
 * namespace holding a clone of it). So no loop device outlives its mount,
 * and a failure before the mount frees it by closing our fd. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <unistd.h>

#include "sbx_ffi.h"

#ifndef LOOP_CONFIGURE /* headers before Linux 5.8; every kernel the holder runs on has it */
#define LOOP_CONFIGURE 0x4C0A
struct loop_config {
    __u32 fd;
    __u32 block_size;
    struct loop_info64 info;
    __u64 __reserved[8];
};
#endif

/* LOOP_CTL_GET_FREE names a device nobody had bound when it answered, but
 * another process may bind it first (LOOP_CONFIGURE then says EBUSY): ask
 * again, up to this many times. */
#define LOOP_ATTEMPTS 64

/* ext4's options: "noinit_itable" spares the kernel zeroing the inode tables
 * in the background (the image is a new sparse file; they read as zeros
 * already), "discard" gives the blocks of deleted files back to the host's
 * file system (the loop device punches holes in the image). */
#define IMAGE_MOUNT_OPTIONS "noinit_itable,discard"

static void loop_path(char *out, size_t size, int number)
{
    snprintf(out, size, "/dev/loop%d", number);
}

/* A loop device bound to image_fd with LO_FLAGS_AUTOCLEAR, opened; its
 * number goes to *number. Returns the fd or -errno. */
static int attach_loop(int image_fd, int *number)
{
    struct loop_config config = {.fd = (__u32)image_fd, .info.lo_flags = LO_FLAGS_AUTOCLEAR};
    int control = open("/dev/loop-control", O_RDWR | O_CLOEXEC), rc = -EBUSY;
    char device[32];

    if (control < 0)
        return -errno;
    for (int attempt = 0; attempt < LOOP_ATTEMPTS && rc == -EBUSY; attempt++) {
        int loop;

        *number = ioctl(control, LOOP_CTL_GET_FREE);
        if (*number < 0) {
            rc = -errno;
            break;
        }
        loop_path(device, sizeof device, *number);
        loop = open(device, O_RDWR | O_CLOEXEC);
        if (loop < 0) {
            rc = -errno;
            break;
        }
        if (ioctl(loop, LOOP_CONFIGURE, &config) == 0) {
            rc = loop;
            break;
        }
        rc = -errno;
        close(loop);
    }
    close(control);
    return rc;
}

/* Mount the ext4 image file at target (nosuid, nodev). Returns the loop
 * device's number, or -errno. */
int sbx_image_mount(const char *image, const char *target)
{
    char device[32];
    int image_fd = open(image, O_RDWR | O_CLOEXEC | O_NOFOLLOW), loop, number = -1, rc;

    if (image_fd < 0)
        return -errno;
    loop = attach_loop(image_fd, &number);
    close(image_fd); /* the loop device holds the file now */
    if (loop < 0)
        return loop;
    loop_path(device, sizeof device, number);
    /* Our fd keeps the device bound until the mount has opened it too. */
    rc = mount(device, target, "ext4", MS_NOSUID | MS_NODEV, IMAGE_MOUNT_OPTIONS) < 0 ? -errno : number;
    close(loop);
    return rc;
}

/* Unmount target. Returns 0, or 1 when it was in use on the host (a
 * process's open file or working directory there): then it is only
 * detached, and the file system and its loop device go when that user lets
 * go. -errno on failure. */
int sbx_image_unmount(const char *target)
{
    if (umount2(target, UMOUNT_NOFOLLOW) == 0)
        return 0;
    if (errno != EBUSY)
        return -errno;
    return umount2(target, UMOUNT_NOFOLLOW | MNT_DETACH) == 0 ? 1 : -errno;
}
