#ifndef SBX_FFI_SPAWN_H
#define SBX_FFI_SPAWN_H

#include "sbx_proto.h"

/* Must match CONTROL_FD in holder.h. */
#define SBX_HOLDER_CONTROL_FD 3

int sbx_spawn_holder(const char *path, char *const argv[], int control_fd);

#endif
