#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include "text_file.h"

int write_text_file(const char *path, const char *text, int extra_flags)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC | extra_flags, 0644);
    ssize_t len = (ssize_t)strlen(text), written;
    int err;

    if (fd < 0)
        return -errno;
    written = write(fd, text, (size_t)len);
    err = written < 0 ? errno : EIO; /* a short write of a short text: the file took less than all */
    close(fd);
    return written == len ? 0 : -err;
}
