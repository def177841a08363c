// check.h: what the C tests assert with. CHECK(cond, fmt, ...) counts a
// pass, or counts a failure and prints where and why; CU(call) runs a driver
// call and, on failure, counts it, prints its error name and jumps to the
// caller's `done:` label. The test programs report `passed` and `failed`.
#ifndef FLASHDECODE_TEST_CHECK_H
#define FLASHDECODE_TEST_CHECK_H

#include <cuda.h>
#include <stdio.h>

static int passed, failed;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (cond) {                                                          \
            passed++;                                                        \
        } else {                                                             \
            failed++;                                                        \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
        }                                                                    \
    } while (0)

#define CU(call)                                                                     \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                    \
            const char *m_ = "?";                                                    \
            cuGetErrorName(r_, &m_);                                                 \
            fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, m_); \
            failed++;                                                                \
            goto done;                                                               \
        }                                                                            \
    } while (0)

#endif  // FLASHDECODE_TEST_CHECK_H
