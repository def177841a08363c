// dev_hooks.h: FD_TRACE(i), the points in stage 1 and the combines that a
// developer tool may time. Nothing in the library build: dev/trace/trace.cu
// defines the macro before it includes the kernels.
#ifndef FLASHDECODE_DEV_HOOKS_H
#define FLASHDECODE_DEV_HOOKS_H

// Stage 1: 1 released from the PDL wait, 7 the first tiles' copies begin,
// 8 they are issued, 2 first tile landed, 3 loop done, 4 rows written. The
// combines: 1 released, 2 a warp's loads merged, 3 the warps met.
#ifndef FD_TRACE
#define FD_TRACE(i)
#endif

#endif  // FLASHDECODE_DEV_HOOKS_H
