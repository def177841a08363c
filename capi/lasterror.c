// lasterror.c: fd_last_error's per-thread message (C thread-local storage: a Go
// goroutine has no fixed thread, but each cgo call from C runs on its caller's).
#include <stdlib.h>
#include <string.h>

#include "flashdecode.h"

static _Thread_local char *last_error;

// fd_set_last_error replaces the calling thread's message with a copy of msg
// (NULL or "" clears it). Internal: called from main.go, not exported.
__attribute__((visibility("hidden"))) void fd_set_last_error(const char *msg) {
    free(last_error);
    last_error = NULL;
    if (msg && *msg) {
        size_t n = strlen(msg) + 1;
        last_error = malloc(n);
        if (last_error) memcpy(last_error, msg, n);
    }
}

const char *fd_last_error(void) { return last_error ? last_error : ""; }
