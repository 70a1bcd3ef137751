/* Shared declarations of the native kernels (one extension, agentspec.targets.kernels._native). */
#ifndef AGENTSPEC_NATIVE_H
#define AGENTSPEC_NATIVE_H
#include <stdint.h>

/* A task range [begin, end) of a parallel call; ctx is the kernel's own arguments. */
typedef void (*agentspec_task)(void *ctx, int64_t begin, int64_t end);

/* Run fn over [0, n) split into `threads` contiguous parts (the caller runs the first). */
void agentspec_parallel(agentspec_task fn, void *ctx, int64_t n, int threads);

#endif
