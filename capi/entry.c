// entry.c: the public functions of libflashdecode.so. Each refuses a call in a child
// forked (without exec) from the process that loaded the library before it enters Go,
// whose runtime (its threads, locks and scheduler) does not survive fork: such a call
// would hang. Otherwise it calls its Go function (main.go, args.go, merge.go).
#define FD_NO_ARGS_OVERLOADS  // this file defines fd_plan & co themselves
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "_cgo_export.h"
#include "flashdecode.h"

void fd_set_last_error(const char *msg);

static volatile sig_atomic_t forked;  // set in a forked child, never cleared

static void fd_child_after_fork(void) { forked = 1; }

__attribute__((constructor)) static void fd_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, fd_child_after_fork);
}

// fd_refuse_in_child records why fn cannot run here and returns FD_ERR_FORKED.
static int fd_refuse_in_child(const char *fn) {
    char msg[FD_LAST_ERROR_MAX];
    snprintf(msg, sizeof msg,
             "flashdecode: %s: called in a child forked from the process that loaded libflashdecode, whose Go "
             "runtime does not survive fork; start workers with the spawn start method, or exec after fork",
             fn);
    fd_set_last_error(msg);
    return FD_ERR_FORKED;
}

#define FD_GUARD()                                               \
    do {                                                         \
        if (forked) return fd_refuse_in_child(__func__);         \
    } while (0)

int fd_prepare(const fd_layout *layout, size_t layout_size, int device, fd_handle *out) {
    FD_GUARD();
    return fdgo_prepare((fd_layout *)layout, layout_size, device, out);
}

int fd_prepare_tensors(const fd_tensors *tensors, size_t tensors_size, fd_handle *out) {
    FD_GUARD();
    return fdgo_prepare_tensors((fd_tensors *)tensors, tensors_size, out);
}

int fd_tensors_layout(const fd_tensors *tensors, size_t tensors_size, fd_layout *layout, size_t layout_size) {
    FD_GUARD();
    return fdgo_tensors_layout((fd_tensors *)tensors, tensors_size, layout, layout_size);
}

int fd_workspace_size(fd_handle h, int64_t seqlen, size_t *bytes) {
    FD_GUARD();
    return fdgo_workspace_size(h.id, seqlen, bytes);
}

int fd_run(fd_handle h, const fd_ptrs *ptrs, size_t ptrs_size, int64_t seqlen, void *workspace,
           size_t workspace_bytes, void *stream) {
    FD_GUARD();
    return fdgo_run(h.id, (fd_ptrs *)ptrs, ptrs_size, seqlen, (uintptr_t)workspace, workspace_bytes,
                    (uintptr_t)stream);
}

int fd_plan(fd_handle h, int64_t seqlen, fd_plan_info *plan) {
    FD_GUARD();
    return fdgo_plan(h.id, seqlen, plan);
}

int fd_plan_json(fd_handle h, int64_t seqlen, char *buf, size_t buf_size, size_t *needed) {
    FD_GUARD();
    return fdgo_plan_json(h.id, seqlen, buf, buf_size, needed);
}

int fd_release(fd_handle h) {
    FD_GUARD();
    return fdgo_release(h.id);
}

// The static strings are read from Go once and kept, so that a forked child still
// gets them.
static const char *fd_static_string(const char *volatile *cache, char *(*get)(void)) {
    const char *s = __atomic_load_n(cache, __ATOMIC_ACQUIRE);
    if (s == NULL && !forked) {
        s = get();
        __atomic_store_n(cache, s, __ATOMIC_RELEASE);
    }
    return s ? s : "";
}

const char *fd_layout_fields(void) {
    static const char *volatile fields;
    return fd_static_string(&fields, fdgo_layout_fields);
}

const char *fd_tensors_fields(void) {
    static const char *volatile fields;
    return fd_static_string(&fields, fdgo_tensors_fields);
}

const char *fd_version(void) {
    static const char *volatile version;
    return fd_static_string(&version, fdgo_version);
}

int fd_decode(const fd_args *args, void *workspace, size_t workspace_bytes, void *stream) {
    FD_GUARD();
    return fdgo_decode((fd_args *)args, NULL, (uintptr_t)workspace, workspace_bytes, (uintptr_t)stream);
}

int fd_decode_serving(const fd_args *args, const fd_serving *serving, void *workspace, size_t workspace_bytes,
                      void *stream) {
    FD_GUARD();
    return fdgo_decode((fd_args *)args, (fd_serving *)serving, (uintptr_t)workspace, workspace_bytes,
                       (uintptr_t)stream);
}

int fd_args_workspace_size(const fd_args *args, size_t *bytes) {
    FD_GUARD();
    return fdgo_args_workspace_size((fd_args *)args, NULL, bytes);
}

int fd_workspace_size_serving(const fd_args *args, const fd_serving *serving, size_t *bytes) {
    FD_GUARD();
    return fdgo_args_workspace_size((fd_args *)args, (fd_serving *)serving, bytes);
}

int fd_args_plan(const fd_args *args, fd_plan_info *plan) {
    FD_GUARD();
    return fdgo_args_plan((fd_args *)args, NULL, plan);
}

int fd_plan_serving(const fd_args *args, const fd_serving *serving, fd_plan_info *plan) {
    FD_GUARD();
    return fdgo_args_plan((fd_args *)args, (fd_serving *)serving, plan);
}

int fd_args_plan_json(const fd_args *args, char *buf, size_t buf_size, size_t *needed) {
    FD_GUARD();
    return fdgo_args_plan_json((fd_args *)args, NULL, buf, buf_size, needed);
}

int fd_plan_json_serving(const fd_args *args, const fd_serving *serving, char *buf, size_t buf_size,
                         size_t *needed) {
    FD_GUARD();
    return fdgo_args_plan_json((fd_args *)args, (fd_serving *)serving, buf, buf_size, needed);
}

int fd_merge_tensors(const fd_merge_tensor *tensors, size_t tensors_size, int64_t num_outs, int64_t num_lses,
                     int64_t flags, void *stream) {
    FD_GUARD();
    return fdgo_merge_tensors((fd_merge_tensor *)tensors, tensors_size, num_outs, num_lses, flags, (uintptr_t)stream);
}

int fd_merge_states(const fd_merge_args *args, void *stream) {
    FD_GUARD();
    return fdgo_merge_states((fd_merge_args *)args, (uintptr_t)stream);
}
