// lasterror.c: fd_last_error's per-thread message (C thread-local storage: a Go
// goroutine has no fixed thread, but each cgo call from C runs on its caller's).
// The message lives in a fixed buffer, not the heap, so a thread that ends after a
// failed call leaves nothing behind.
#include <string.h>

#include "flashdecode.h"

static _Thread_local char last_error[FD_LAST_ERROR_MAX];

// fd_set_last_error replaces the calling thread's message with a copy of msg
// (NULL or "" clears it), cut to FD_LAST_ERROR_MAX - 1 bytes. Internal: called
// from main.go, not exported.
__attribute__((visibility("hidden"))) void fd_set_last_error(const char *msg) {
    size_t n = 0;
    while (msg && n < FD_LAST_ERROR_MAX - 1 && msg[n] != '\0') n++;
    if (n) memcpy(last_error, msg, n);
    last_error[n] = '\0';
}

const char *fd_last_error(void) { return last_error; }
