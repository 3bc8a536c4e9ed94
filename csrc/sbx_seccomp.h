/* The guest's seccomp filter (seccomp.c), for the holder and, through the
 * Python extension, for bwrap's --seccomp. */
#ifndef SBX_SECCOMP_H
#define SBX_SECCOMP_H

#include <linux/filter.h>
#include <stddef.h>

#define SBX_SECCOMP_MAX_INSNS 256

/* Writes the program into out; returns its length in instructions, or 0 if
 * it does not fit in capacity. */
size_t sbx_seccomp_program(struct sock_filter *out, size_t capacity);

/* The program as bytes (what bwrap --seccomp reads); returns their number,
 * or -ENOSPC. */
int sbx_seccomp_export(unsigned char *out, size_t size);

#endif
