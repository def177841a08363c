// check.h: the one assertion the C tests use. CHECK(cond, fmt, ...) counts a
// pass, or counts a failure and prints where and why; each test program
// defines `passed` and `failed` and reports them at the end.
#ifndef FLASHDECODE_TEST_CHECK_H
#define FLASHDECODE_TEST_CHECK_H

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

#endif  // FLASHDECODE_TEST_CHECK_H
