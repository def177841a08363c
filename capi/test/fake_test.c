// fake_test.c: libflashdecode.so's success path on the fake-device driver of
// python/build_backend/make_libcuda.py --fake-device (one sm_90 device of 132 SMs whose
// kernels do nothing; its "device memory" is host memory). It checks that fd_decode,
// fd_decode_serving, fd_run and fd_merge_states return FD_OK and launch what fd_plan and
// fd_plan_serving say, by the launches the driver logs to FAKECUDA_LAUNCH_LOG, and the
// workspace refusals that only a device-backed call reaches. No result is computed:
// decode_test.c checks results on a GPU.
//
//   FAKECUDA_LAUNCH_LOG=<file> LD_LIBRARY_PATH=<lib dir>:<fake-device dir> ./fake_test
//
// Prints one line per failure and a closing "N passed, M failed"; exits 1 on failure.
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashdecode.h"
#include "check.h"

// One logged launch: kernel grid.x grid.y grid.z threads shared cluster pdl.
typedef struct {
    char kernel[128];
    unsigned grid[3], threads, shared, cluster;
    int pdl;
} launch;

static const char *log_path;

// launches_since reads the log's launches after its first `skip` lines into out (at
// most max); returns how many there are in all after skip.
static int launches_since(int skip, launch *out, int max) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    int n = 0, line = 0;
    launch l;
    while (fscanf(f, "%127s %u %u %u %u %u %u %d", l.kernel, &l.grid[0], &l.grid[1], &l.grid[2], &l.threads,
                  &l.shared, &l.cluster, &l.pdl) == 8) {
        if (line++ < skip) continue;
        if (n < max) out[n] = l;
        n++;
    }
    fclose(f);
    return n;
}

static int logged(void) { return launches_since(0, NULL, 0); }

// expect_stage1 checks that l is the stage-1 launch of plan p.
static void expect_stage1(const char *what, const launch *l, const fd_plan_info *p) {
    CHECK(strcmp(l->kernel, p->kernel) == 0 && l->grid[0] == (unsigned)p->grid[0] &&
              l->grid[1] == (unsigned)p->grid[1] && l->grid[2] == (unsigned)p->grid[2] &&
              l->threads == (unsigned)p->threads && l->shared == (unsigned)p->shared_bytes &&
              l->cluster == (unsigned)p->cluster,
          "%s: launched %s (%u,%u,%u) x %u, %u B, cluster %u; planned %s (%d,%d,%d) x %d, %d B, cluster %d", what,
          l->kernel, l->grid[0], l->grid[1], l->grid[2], l->threads, l->shared, l->cluster, p->kernel, p->grid[0],
          p->grid[1], p->grid[2], p->threads, p->shared_bytes, p->cluster);
}

// dense returns a contiguous (b, s, h, d) tensor at ptr.
static fd_tensor dense(CUdeviceptr ptr, int64_t s, int64_t h, int64_t d) {
    return (fd_tensor){ptr, s * h * d, h * d, d};
}

// Device buffers of the calls below, one allocation each.
static CUdeviceptr q, k, v, out, lse, lens, k_new, v_new, cos_t, sin_t, ws;

static fd_args decode_args(int num_splits) {
    fd_args a;
    memset(&a, 0, sizeof a);
    a.dtype = FD_FLOAT16;
    a.batch = 2, a.seqlen_q = 1, a.heads_q = 32, a.heads_kv = 8, a.head_dim = 128;
    a.seqlen_cache = 4096, a.seqlen = -1, a.num_splits = num_splits, a.device = 0;
    a.q = dense(q, 1, 32, 128), a.out = dense(out, 1, 32, 128);
    a.k = dense(k, 4096, 8, 128), a.v = dense(v, 4096, 8, 128);
    a.lse = lse, a.cache_seqlens = lens;
    return a;
}

static void test_decode(void) {
    // One split per block, the cluster merge, the combine: each as planned.
    const int splits[] = {1, 8, 40};
    for (size_t i = 0; i < sizeof splits / sizeof splits[0]; i++) {
        fd_args a = decode_args(splits[i]);
        fd_plan_info p;
        size_t bytes = 0;
        int rc = fd_plan(&a, &p);
        CHECK(rc == FD_OK && fd_workspace_size(&a, &bytes) == FD_OK && bytes == (size_t)p.workspace_bytes,
              "%d splits: plan rc %d, workspace %zu (%s)", splits[i], rc, bytes, fd_last_error());
        int before = logged();
        rc = fd_decode(&a, bytes ? (void *)ws : NULL, bytes, NULL);
        CHECK(rc == FD_OK && fd_last_error()[0] == '\0', "%d splits: fd_decode %d \"%s\"", splits[i], rc,
              fd_last_error());
        launch l[3];
        int n = launches_since(before, l, 3);
        int want = p.combine_grid > 0 ? 2 : 1;
        CHECK(n == want, "%d splits: %d launches, want %d", splits[i], n, want);
        if (n < 1) continue;
        expect_stage1("fd_decode", &l[0], &p);
        if (n == 2 && want == 2)
            CHECK(strcmp(l[1].kernel, p.combine) == 0 && l[1].grid[0] == (unsigned)p.combine_grid &&
                      l[1].threads == (unsigned)p.combine_threads,
                  "combine: launched %s %u x %u, planned %s %d x %d", l[1].kernel, l[1].grid[0], l[1].threads,
                  p.combine, p.combine_grid, p.combine_threads);
    }
}

static void test_workspace_refusals(void) {
    fd_args a = decode_args(40);
    size_t bytes = 0;
    CHECK(fd_workspace_size(&a, &bytes) == FD_OK && bytes > 0, "40 splits need a workspace: %zu", bytes);
    int before = logged();
    int rc = fd_decode(&a, NULL, bytes, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "workspace: invalid argument: null device pointer"),
          "NULL workspace: %d \"%s\"", rc, fd_last_error());
    rc = fd_decode(&a, (void *)ws, bytes - 1, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": workspace: "), "short workspace: %d \"%s\"", rc,
          fd_last_error());
    rc = fd_decode(&a, (void *)(ws + 8), bytes, NULL);
    CHECK(rc != FD_OK && strstr(fd_last_error(), ": workspace: "), "workspace 8-byte aligned: %d \"%s\"", rc,
          fd_last_error());
    rc = fd_decode(&a, (void *)k, bytes, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": workspace: "), "workspace in k: %d \"%s\"", rc,
          fd_last_error());
    CHECK(logged() == before, "a refused call launched %d kernels", logged() - before);
    // A capacity past INT64_MAX is more than enough.
    rc = fd_decode(&a, (void *)ws, SIZE_MAX, NULL);
    CHECK(rc == FD_OK, "workspace_bytes SIZE_MAX: %d \"%s\"", rc, fd_last_error());
}

static void test_decode_serving(void) {
    // An append rotated over 64 channels: the append kernel, then stage 1 (and the combine).
    fd_args a = decode_args(0);
    a.seqlen_q = 2;
    a.q = dense(q, 2, 32, 128), a.out = dense(out, 2, 32, 128);
    fd_serving s;
    memset(&s, 0, sizeof s);
    s.seqlen_new = 2;
    s.k_new = dense(k_new, 2, 8, 128), s.v_new = dense(v_new, 2, 8, 128);
    s.rotary_dim = 64, s.rotary_cos = cos_t, s.rotary_sin = sin_t, s.rotary_stride = 32, s.rotary_rows = 4096;
    fd_plan_info p;
    size_t bytes = 0;
    int rc = fd_plan_serving(&a, &s, &p);
    CHECK(rc == FD_OK && fd_workspace_size_serving(&a, &s, &bytes) == FD_OK && bytes == (size_t)p.workspace_bytes &&
              bytes > 0,
          "append + rotary: plan rc %d, workspace %zu (%s)", rc, bytes, fd_last_error());
    char json[8192];
    rc = fd_plan_json_serving(&a, &s, json, sizeof json, NULL);
    const char *append = strstr(json, "\"append\":\"");
    CHECK(rc == FD_OK && append, "plan_json_serving: %d %s", rc, json);
    int before = logged();
    rc = fd_decode_serving(&a, &s, (void *)ws, bytes, NULL);
    CHECK(rc == FD_OK, "fd_decode_serving: %d \"%s\"", rc, fd_last_error());
    launch l[4];
    int n = launches_since(before, l, 4);
    int want = 2 + (p.combine_grid > 0);
    CHECK(n == want, "append + rotary: %d launches, want %d", n, want);
    if (n >= 2 && append) {
        append += strlen("\"append\":\"");
        CHECK(strncmp(l[0].kernel, append, strlen(l[0].kernel)) == 0 && append[strlen(l[0].kernel)] == '"',
              "first launch %s, planned append %.40s", l[0].kernel, append);
        expect_stage1("fd_decode_serving", &l[1], &p);
    }
}

// The prepared API runs what fd_plan says, call after call, like fd_decode; a refused
// run launches nothing.
static void test_prepared(void) {
    fd_layout l;
    memset(&l, 0, sizeof l);
    l.dtype = FD_FLOAT16, l.batch = 2, l.seqlen_q = 1, l.heads_q = 32, l.heads_kv = 8, l.head_dim = 128;
    l.seqlen_cache = 4096, l.num_splits = 40, l.device_lengths = 1, l.window_left = l.window_right = -1;
    const int64_t qs[4] = {32 * 128, 32 * 128, 128, 1}, kvs[4] = {4096 * 8 * 128, 8 * 128, 128, 1};
    memcpy(l.q, qs, sizeof qs), memcpy(l.out, qs, sizeof qs), memcpy(l.k_cache, kvs, sizeof kvs);
    memcpy(l.v_cache, kvs, sizeof kvs);
    fd_handle h;
    int rc = fd_prepare(&l, sizeof l, 0, &h);
    CHECK(rc == FD_OK, "fd_prepare: %d \"%s\"", rc, fd_last_error());
    if (rc != FD_OK) return;
    fd_plan_info p;
    size_t bytes = 0;
    rc = fd_plan(h, 3000, &p);
    CHECK(rc == FD_OK && fd_workspace_size(h, 3000, &bytes) == FD_OK && bytes == (size_t)p.workspace_bytes && bytes > 0,
          "plan rc %d, workspace %zu (%s)", rc, bytes, fd_last_error());
    fd_ptrs ptrs;
    memset(&ptrs, 0, sizeof ptrs);
    ptrs.q = q, ptrs.out = out, ptrs.k_cache = k, ptrs.v_cache = v, ptrs.lse = lse, ptrs.cache_seqlens = lens;
    for (int call = 0; call < 2; call++) {
        int before = logged();
        rc = fd_run(h, &ptrs, sizeof ptrs, 3000, (void *)ws, bytes, NULL);
        CHECK(rc == FD_OK && fd_last_error()[0] == '\0', "fd_run %d: %d \"%s\"", call, rc, fd_last_error());
        launch got[3];
        int n = launches_since(before, got, 3);
        CHECK(n == 2, "fd_run %d: %d launches, want stage 1 and the combine", call, n);
        if (n >= 1) expect_stage1("fd_run", &got[0], &p);
        if (n == 2)
            CHECK(strcmp(got[1].kernel, p.combine) == 0 && got[1].grid[0] == (unsigned)p.combine_grid,
                  "combine: launched %s x %u, planned %s x %d", got[1].kernel, got[1].grid[0], p.combine, p.combine_grid);
    }
    int before = logged();
    rc = fd_run(h, &ptrs, sizeof ptrs, 3000, (void *)ws, bytes - 1, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": workspace: ") && logged() == before,
          "a short workspace: %d \"%s\", %d launches", rc, fd_last_error(), logged() - before);
    CHECK(fd_release(h) == FD_OK, "fd_release: \"%s\"", fd_last_error());
}

static void test_merge(void) {
    // Three stacked fp16 states of (2, 32) rows of 128: one merge kernel, a block a row.
    fd_merge_args m;
    memset(&m, 0, sizeof m);
    m.dtype = FD_FLOAT16, m.num_states = 3, m.head_dim = 128, m.device = 0;
    m.rows[0] = 2, m.rows[1] = 32, m.rows[2] = 1;
    m.outs.num_ptrs = 1, m.outs.ptrs[0] = k, m.outs.state_stride = 2 * 32 * 128;
    m.outs.row_strides[0] = 32 * 128, m.outs.row_strides[1] = 128;
    m.lses.num_ptrs = 1, m.lses.ptrs[0] = lse, m.lses.state_stride = 2 * 32;
    m.lses.row_strides[0] = 32, m.lses.row_strides[1] = 1;
    m.out = out, m.out_strides[0] = 32 * 128, m.out_strides[1] = 128;
    int before = logged();
    int rc = fd_merge_states(&m, NULL);
    launch l[2];
    int n = launches_since(before, l, 2);
    CHECK(rc == FD_OK && n == 1 && strcmp(l[0].kernel, "fd_merge_states_f16") == 0 && l[0].grid[0] == 64,
          "fd_merge_states: rc %d \"%s\", %d launches, %s x %u", rc, fd_last_error(), n, n ? l[0].kernel : "-",
          n ? l[0].grid[0] : 0);
}

int main(void) {
    log_path = getenv("FAKECUDA_LAUNCH_LOG");
    if (!log_path) {
        fprintf(stderr, "fake_test: set FAKECUDA_LAUNCH_LOG (and load the fake-device libcuda.so.1)\n");
        return 1;
    }
    CUcontext ctx = NULL;
    int devices = 0;
    CU(cuInit(0));
    CU(cuDeviceGetCount(&devices));
    CHECK(devices == 1, "the fake-device driver reports %d devices", devices);
    CU(cuDevicePrimaryCtxRetain(&ctx, 0));
    CU(cuCtxSetCurrent(ctx));
    const size_t mb = 1 << 20;
    CU(cuMemAlloc(&q, mb));
    CU(cuMemAlloc(&out, mb));
    CU(cuMemAlloc(&lse, mb));
    CU(cuMemAlloc(&lens, 256));
    CU(cuMemAlloc(&k, 16 * mb));
    CU(cuMemAlloc(&v, 16 * mb));
    CU(cuMemAlloc(&k_new, mb));
    CU(cuMemAlloc(&v_new, mb));
    CU(cuMemAlloc(&cos_t, mb));
    CU(cuMemAlloc(&sin_t, mb));
    CU(cuMemAlloc(&ws, 64 * mb));
    test_decode();
    test_workspace_refusals();
    test_decode_serving();
    test_prepared();
    test_merge();
done:
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
