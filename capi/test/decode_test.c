// decode_test.c: tests libflashdecode.so through its public header, as a C user would.
//
// Without a GPU (e.g. CI with the stand-in libcuda.so.1 of python/build_backend/make_libcuda.py) it checks the
// planner (device -1), the errors (code and fd_last_error text, per thread) and that
// nothing crashes. With a GPU it also runs fd_decode on small problems in device memory
// from the driver API and compares against a CPU reference in double precision.
//
//   cc -std=c11 -O2 -Icapi -I$CUDA_HOME/include capi/test/decode_test.c -L<lib dir> -lflashdecode
//      -L<libcuda dir> -lcuda -lpthread -lm -o decode_test
//   LD_LIBRARY_PATH=<lib dir>[:<stand-in libcuda dir>] ./decode_test
//
// Prints one line per failure and a closing "N passed, M failed"; exits 1 on failure.
#include <cuda.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashdecode.h"
#include "check.h"


// ---- planning and errors: no GPU needed ---------------------------------------------

// shape_args returns fd_args with only shapes set (b=1, 32/8 heads, d=128, 32K cache).
static fd_args shape_args(void) {
    fd_args a;
    memset(&a, 0, sizeof a);
    a.dtype = FD_FLOAT16;
    a.batch = 1;
    a.seqlen_q = 1;
    a.heads_q = 32;
    a.heads_kv = 8;
    a.head_dim = 128;
    a.seqlen_cache = 32768;
    a.seqlen = -1;
    a.device = -1;
    return a;
}

static void test_version(void) {
    const char *v = fd_version();
    CHECK(v && v[0] >= '0' && v[0] <= '9', "fd_version() = \"%s\"", v ? v : "(null)");
}

static void test_plan(void) {
    fd_args a = shape_args();
    fd_plan_info p;
    memset(&p, 0xff, sizeof p);
    int rc = fd_plan(&a, &p);
    CHECK(rc == FD_OK, "fd_plan: %d %s", rc, fd_last_error());
    if (rc != FD_OK) return;
    CHECK(strcmp(fd_last_error(), "") == 0, "fd_last_error after success: \"%s\"", fd_last_error());
    CHECK(p.kernel[0] != '\0' && memchr(p.kernel, 0, sizeof p.kernel), "kernel name");
    CHECK(p.num_splits >= 1 && p.num_splits <= 128, "num_splits %d", p.num_splits);
    CHECK(p.grid[0] == p.num_splits && p.grid[2] == a.batch, "grid (%d,%d,%d)", p.grid[0], p.grid[1], p.grid[2]);
    CHECK(p.grid[1] == a.heads_kv * p.row_tiles, "grid.y %d != heads_kv*row_tiles %d", p.grid[1], a.heads_kv * p.row_tiles);
    CHECK(p.threads > 0 && p.sms > 0 && p.blocks_per_sm > 0, "threads %d sms %d blocks/SM %d", p.threads, p.sms, p.blocks_per_sm);
    CHECK(p.cluster == 1 || p.cluster == p.num_splits, "cluster %d for %d splits", p.cluster, p.num_splits);
    CHECK((p.combine_grid > 0) == (p.num_splits > 1 && p.cluster == 1), "combine grid %d for %d splits, cluster %d",
          p.combine_grid, p.num_splits, p.cluster);
    CHECK((p.combine_grid == 0) == (p.workspace_bytes == 0), "workspace %lld for combine grid %d",
          (long long)p.workspace_bytes, p.combine_grid);
    if (p.combine_grid > 0) {
        int64_t rows = (int64_t)a.batch * a.heads_q * a.seqlen_q;
        CHECK(p.lse_partial_offset >= p.num_splits * rows * a.head_dim * 4 && p.lse_partial_offset % 256 == 0,
              "lse_partial_offset %lld", (long long)p.lse_partial_offset);
        CHECK(p.combine_grid > 0 && p.combine_threads > 0 && p.combine[0] != '\0', "combine launch");
    }
    // A long cache on one sequence must be split (that is the point of flash decoding).
    CHECK(p.num_splits > 1, "b=1 32K cache planned with %d split(s)", p.num_splits);

    size_t ws = 12345;
    rc = fd_workspace_size(&a, &ws);
    CHECK(rc == FD_OK && ws == (size_t)p.workspace_bytes, "fd_workspace_size %d: %zu vs %lld", rc, ws,
          (long long)p.workspace_bytes);

    // More items (8 x 48 K/V heads, 10 rows each) than an H200 holds at once
    // (264): the full wave whole, the other items split, merged from the
    // first split item's first row.
    fd_args t = shape_args();
    t.batch = 8;
    t.seqlen_q = 10;
    t.heads_q = t.heads_kv = 48;
    t.seqlen_cache = 4096;
    rc = fd_plan(&t, &p);
    const int items = t.batch * t.heads_kv;
    char json[4096];
    int whole = -1, row0 = -1, rows = -1;
    if (rc == FD_OK && fd_plan_json(&t, json, sizeof json, NULL) == FD_OK) {
        const char *w = strstr(json, "\"whole_items\":"), *r = strstr(json, "\"combine_row0\":");
        if (w) whole = atoi(w + strlen("\"whole_items\":"));
        if (r) row0 = atoi(r + strlen("\"combine_row0\":"));
        /* rows a combine block merges: the plan's combine_rows follows the variant's */
        for (const char *c = strstr(json, "\"combine_rows\":"); c; c = strstr(c + 1, "\"combine_rows\":"))
            rows = atoi(c + strlen("\"combine_rows\":"));
    }
    CHECK(rc == FD_OK && whole > 0 && whole < items && p.num_splits > 1 && p.cluster == 1 &&
              p.grid[0] == whole + (items - whole) * p.num_splits && p.grid[1] == 1 && p.grid[2] == 1 &&
              row0 == whole * 10 && rows > 0 && p.combine_grid == ((items - whole) * 10 + rows - 1) / rows,
          "tail split: rc %d, %d whole, %d splits, grid (%d,%d,%d), combine %d from row %d", rc, whole,
          p.num_splits, p.grid[0], p.grid[1], p.grid[2], p.combine_grid, row0);

    a.num_splits = 1;
    rc = fd_plan(&a, &p);
    CHECK(rc == FD_OK && p.num_splits == 1 && p.workspace_bytes == 0 && p.combine_grid == 0,
          "num_splits=1: rc %d splits %d ws %lld", rc, p.num_splits, (long long)p.workspace_bytes);
    a.num_splits = 100000;
    rc = fd_plan(&a, &p);
    CHECK(rc == FD_OK && p.num_splits >= 1 && p.num_splits <= 128, "num_splits=100000 clamped to %d", p.num_splits);
}

static void test_plan_json(void) {
    fd_args a = shape_args();
    size_t need = 0;
    int rc = fd_plan_json(&a, NULL, 0, &need);
    CHECK(rc == FD_ERR_BUFFER && need > 2, "size query: rc %d need %zu", rc, need);
    CHECK(strstr(fd_last_error(), "buf") != NULL, "buffer error text: \"%s\"", fd_last_error());
    char small[8] = "xxxxxxx";
    rc = fd_plan_json(&a, small, sizeof small, &need);
    CHECK(rc == FD_ERR_BUFFER && strcmp(small, "xxxxxxx") == 0, "small buffer untouched: rc %d", rc);
    char *buf = malloc(need);
    rc = fd_plan_json(&a, buf, need, NULL);
    CHECK(rc == FD_OK && buf[0] == '{' && strlen(buf) + 1 == need, "json rc %d: %s", rc, buf);
    CHECK(strstr(buf, "\"num_splits\"") && strstr(buf, "\"workspace_bytes\""), "json fields: %s", buf);
    // A capacity past INT64_MAX ("large enough") is large enough.
    rc = fd_plan_json(&a, buf, SIZE_MAX, NULL);
    CHECK(rc == FD_OK && buf[0] == '{', "buf_size SIZE_MAX: rc %d (%s)", rc, fd_last_error());
    free(buf);
    // NULL with a size is a mistake, not a size query.
    rc = fd_plan_json(&a, NULL, 4096, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": buf: "), "NULL buf of 4096 bytes: rc %d \"%s\"", rc,
          fd_last_error());
}

// expect_error calls fd_plan and fd_workspace_size on a and checks both fail with code
// and a message containing word.
static void expect_error(const char *what, fd_args a, int code, const char *word) {
    fd_plan_info p;
    int rc = fd_plan(&a, &p);
    CHECK(rc == code, "%s: fd_plan returned %d, want %d (%s)", what, rc, code, fd_last_error());
    CHECK(strstr(fd_last_error(), word) != NULL, "%s: fd_last_error \"%s\" lacks \"%s\"", what, fd_last_error(), word);
    size_t ws;
    rc = fd_workspace_size(&a, &ws);
    CHECK(rc == code, "%s: fd_workspace_size returned %d, want %d", what, rc, code);
}

static void test_errors(void) {
    fd_args a = shape_args();
    a.heads_q = 12;
    a.heads_kv = 5;
    expect_error("heads 12/5", a, FD_ERR_INVALID, ": heads_q: ");
    a = shape_args();
    a.batch = -3;
    expect_error("batch -3", a, FD_ERR_INVALID, "batch");
    a = shape_args();
    a.dtype = 7;
    expect_error("dtype 7", a, FD_ERR_UNSUPPORTED, "dtype");
    a = shape_args();
    a.num_splits = -1;
    expect_error("num_splits -1", a, FD_ERR_INVALID, "num_splits");
    a = shape_args();
    a.head_dim = 512;
    expect_error("head_dim 512", a, FD_ERR_UNSUPPORTED, ": head_dim: ");
    // Errors name fd_args' fields: without cache_seqlens the lengths are seqlen.
    a = shape_args();
    a.seqlen = a.seqlen_cache + 1;
    expect_error("seqlen past the cache", a, FD_ERR_INVALID, ": seqlen: ");

    fd_plan_info p;
    int rc = fd_plan(NULL, &p);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "args"), "fd_plan(NULL): %d \"%s\"", rc, fd_last_error());
    a = shape_args();
    rc = fd_plan(&a, NULL);
    CHECK(rc == FD_ERR_INVALID, "fd_plan(&a, NULL): %d", rc);
    rc = fd_decode(NULL, NULL, 0, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "args"), "fd_decode(NULL): %d \"%s\"", rc, fd_last_error());

    // Device pointers left at 0: rejected before any device work, on any machine.
    a = shape_args();
    a.device = 0;
    rc = fd_decode(&a, NULL, 0, NULL);
    CHECK(rc == FD_ERR_INVALID && fd_last_error()[0] != '\0', "decode with NULL tensors: %d \"%s\"", rc,
          fd_last_error());

    // The library keeps working after errors, and success clears the message.
    a = shape_args();
    rc = fd_plan(&a, &p);
    CHECK(rc == FD_OK && fd_last_error()[0] == '\0', "plan after errors: %d \"%s\"", rc, fd_last_error());
}

// Without a device, asking about device 0 (or a nonsense one) is an error, not a crash:
// FD_ERR_INVALID naming the function's operation and the device.
static void test_no_device(void) {
    fd_args a = shape_args();
    fd_plan_info p;
    a.device = 0;
    int rc = fd_plan(&a, &p);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": plan: device: "), "plan on missing device 0: %d \"%s\"",
          rc, fd_last_error());
    a.device = 999;
    rc = fd_plan(&a, &p);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": plan: device: "), "plan on device 999: %d \"%s\"", rc,
          fd_last_error());
}

static void *fail_in_thread(void *arg) {
    (void)arg;
    fd_args a = shape_args();
    a.heads_kv = 0;
    fd_plan_info p;
    int rc = fd_plan(&a, &p);
    return (void *)(intptr_t)(rc != FD_OK && fd_last_error()[0] != '\0');
}

static void test_error_per_thread(void) {
    fd_args a = shape_args();
    fd_plan_info p;
    fd_plan(&a, &p);  // success: clears this thread's message
    pthread_t t;
    void *ok = NULL;
    CHECK(pthread_create(&t, NULL, fail_in_thread, NULL) == 0, "pthread_create");
    pthread_join(t, &ok);
    CHECK(ok != NULL, "the other thread saw its error");
    CHECK(fd_last_error()[0] == '\0', "another thread's error leaked here: \"%s\"", fd_last_error());
}

// ---- serving features: planning and checks, no GPU needed ----------------------------

// serving_args is shape_args with dense tensors at aligned, far apart (never
// dereferenced) addresses, seqlen_q 2, cache_seqlens set: valid for
// fd_decode_serving's checks.
static fd_args serving_args(void) {
    fd_args a = shape_args();
    a.seqlen_q = 2;
    a.seqlen_cache = 4096;
    int64_t d = a.head_dim;
    a.q = (fd_tensor){0x1000000, 2 * 32 * d, 32 * d, d};
    a.out = (fd_tensor){0x2000000, 2 * 32 * d, 32 * d, d};
    a.k = (fd_tensor){0x10000000, 4096 * 8 * d, 8 * d, d};
    a.v = (fd_tensor){0x20000000, 4096 * 8 * d, 8 * d, d};
    a.cache_seqlens = 0x3000000;
    return a;
}

// paged makes a and s a paged cache of 600 pages of 16 keys, 256 a sequence.
static void paged(fd_args *a, fd_serving *s) {
    s->page_size = 16;
    s->num_pages = 600;
    s->max_pages = 256;
    s->block_table = 0x4000000;
    s->block_table_stride = 256;
    a->k.batch_stride = a->v.batch_stride = 16 * 8 * 128;
}

// appending makes s append 3 tokens a sequence, rotated over 64 channels.
static void appending(fd_serving *s) {
    s->seqlen_new = 3;
    s->k_new = (fd_tensor){0x5000000, 3 * 8 * 128, 8 * 128, 128};
    s->v_new = (fd_tensor){0x6000000, 3 * 8 * 128, 8 * 128, 128};
    s->rotary_dim = 64;
    s->rotary_cos = 0x7000000;
    s->rotary_sin = 0x8000000;
    s->rotary_stride = 32;
    s->rotary_rows = 8192;
}

static void test_serving_plan(void) {
    fd_args a = shape_args();
    fd_serving s;
    memset(&s, 0, sizeof s);
    fd_plan_info p, q;
    size_t ws = 1, ws0 = 2;

    // A zeroed fd_serving, or NULL, is fd_plan and fd_workspace_size.
    int rc = fd_plan_serving(&a, &s, &p);
    CHECK(rc == FD_OK && fd_plan(&a, &q) == FD_OK && memcmp(&p, &q, sizeof p) == 0, "zeroed fd_serving: rc %d, kernel %s",
          rc, p.kernel);
    CHECK(fd_workspace_size_serving(&a, NULL, &ws) == FD_OK && fd_workspace_size(&a, &ws0) == FD_OK && ws == ws0,
          "NULL fd_serving: workspace %zu, fd_workspace_size %zu", ws, ws0);

    // Paged (pages of a multiple of 8 keys, no other feature): the paged form
    // of the serving kernel of the same head dim and rows, split to fill two
    // blocks an SM where the plain plan fills one (b=1, 32/8 heads, 32K
    // tokens on an H200: 32 splits against 16).
    paged(&a, &s);
    s.num_pages = s.max_pages = a.seqlen_cache / s.page_size;
    rc = fd_plan_serving(&a, &s, &p);
    CHECK(rc == FD_OK && strcmp(p.kernel, "fd_split_kv_paged_f16_d128_r16") == 0 && q.num_splits == 16 &&
              p.num_splits == 32 && p.grid[0] == 32 && p.threads == q.threads,
          "paged: rc %d, kernel %s, %d splits (%s)", rc, p.kernel, p.num_splits, fd_last_error());

    // Append with rotary, one split: the workspace holds only the rotated q.
    memset(&s, 0, sizeof s);
    a = serving_args();
    a.num_splits = 1;
    appending(&s);
    rc = fd_workspace_size_serving(&a, &s, &ws);
    CHECK(rc == FD_OK && ws == (size_t)a.batch * a.seqlen_q * a.heads_q * a.head_dim * 2,
          "append + rotary, 1 split: rc %d, workspace %zu (%s)", rc, ws, fd_last_error());
    // With the combine (more splits than a cluster): partials, then q_rot.
    a.num_splits = 40;
    rc = fd_plan_serving(&a, &s, &p);
    int64_t rows = (int64_t)a.batch * a.heads_q * a.seqlen_q;
    CHECK(rc == FD_OK && p.combine_grid > 0 &&
              p.workspace_bytes == p.lse_partial_offset + 40 * rows * 4 + rows * a.head_dim * 2,
          "append + rotary, 40 splits: rc %d, workspace %lld, lse_partial at %lld", rc, (long long)p.workspace_bytes,
          (long long)p.lse_partial_offset);
    // Without rotary, the contiguous cache's appending form: no append kernel.
    s.rotary_dim = 0;
    s.rotary_cos = s.rotary_sin = 0;
    rc = fd_plan_serving(&a, &s, &p);
    CHECK(rc == FD_OK && strcmp(p.kernel, "fd_split_kv_append_f16_d128_r16") == 0,
          "append without rotary: rc %d, kernel %s (%s)", rc, p.kernel, fd_last_error());
    char json[4096];
    rc = fd_plan_json(&a, json, sizeof json, NULL);
    CHECK(rc == FD_OK && strstr(json, "fd_append_kv") == NULL, "fd_plan_json without serving: %s", json);

    // A window of 100 keys plans 2 key tiles of 64.
    memset(&s, 0, sizeof s);
    a = shape_args();
    a.num_splits = 9;
    s.window = 1;
    s.window_left = 97;
    s.window_right = 0;
    rc = fd_plan_serving(&a, &s, &p);
    CHECK(rc == FD_OK && p.num_splits == 2, "window (97, 0): rc %d, %d splits", rc, p.num_splits);

    // Shape errors of the serving fields surface when planning.
    memset(&s, 0, sizeof s);
    a = shape_args();
    s.seqlen_new = a.seqlen_cache + 1;
    rc = fd_workspace_size_serving(&a, &s, &ws);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), ": k_new:"), "seqlen_new past the cache: %d \"%s\"", rc,
          fd_last_error());

    // The size queries refuse what fd_decode_serving refuses whatever the tensors.
    struct {
        const char *what, *arg;
        fd_serving s;
        int seqlen;
    } bad[6];
    memset(bad, 0, sizeof bad);
    bad[0].what = "page_size -5", bad[0].arg = "page_size", bad[0].s.page_size = -5;
    bad[1].what = "window (-7, -9)", bad[1].arg = "window", bad[1].s.window = 1;
    bad[1].s.window_left = -7, bad[1].s.window_right = -9;
    bad[2].what = "softcap -3", bad[2].arg = "softcap", bad[2].s.softcap = -3;
    bad[3].what = "max_pages * page_size != seqlen_cache", bad[3].arg = "seqlen_cache";
    bad[3].s.page_size = 16, bad[3].s.num_pages = 600, bad[3].s.max_pages = 3;
    appending(&bad[4].s);
    bad[4].what = "an append past the cache", bad[4].arg = "seqlen", bad[4].seqlen = 4094;
    appending(&bad[5].s);
    bad[5].what = "an append with no lengths", bad[5].arg = "seqlen", bad[5].seqlen = -1;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        a = shape_args();
        a.seqlen_cache = 4096;
        a.seqlen = bad[i].seqlen;
        char want[64];
        snprintf(want, sizeof want, ": %s: ", bad[i].arg);
        rc = fd_workspace_size_serving(&a, &bad[i].s, &ws);
        CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), want), "%s: fd_workspace_size_serving %d \"%s\"",
              bad[i].what, rc, fd_last_error());
        rc = fd_plan_serving(&a, &bad[i].s, &p);
        CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), want), "%s: fd_plan_serving %d \"%s\"", bad[i].what, rc,
              fd_last_error());
    }

    // fd_plan_json_serving shows the serving plan whole: its append kernel and q_rot_offset.
    memset(&s, 0, sizeof s);
    a = serving_args();
    a.num_splits = 40;
    appending(&s);
    rc = fd_plan_json_serving(&a, &s, json, sizeof json, NULL);
    CHECK(rc == FD_OK && strstr(json, "\"append\":\"fd_append_kv") && strstr(json, "\"q_rot_offset\":"),
          "fd_plan_json_serving: rc %d %s (%s)", rc, json, fd_last_error());
}

// expect_serving_error calls fd_decode_serving on a and s and checks it fails with code
// and a message naming arg, before any device work.
static void expect_serving_error(const char *what, fd_args a, fd_serving s, int code, const char *arg) {
    int rc = fd_decode_serving(&a, &s, NULL, 0, NULL);
    char want[64];
    snprintf(want, sizeof want, ": %s: ", arg);
    CHECK(rc == code && strstr(fd_last_error(), want), "%s: fd_decode_serving returned %d \"%s\", want %d naming %s",
          what, rc, fd_last_error(), code, arg);
}

static void test_serving_errors(void) {
    fd_args a = serving_args(), pa = serving_args();
    fd_serving s, ps, as;
    memset(&s, 0, sizeof s);
    ps = as = s;
    paged(&pa, &ps);
    appending(&as);

    fd_serving e = ps;
    e.page_size = -1;
    expect_serving_error("page_size -1", pa, e, FD_ERR_INVALID, "page_size");
    e = ps;
    e.max_pages = 255;
    expect_serving_error("seqlen_cache not max_pages * page_size", pa, e, FD_ERR_INVALID, "seqlen_cache");
    e = ps;
    e.num_pages = 0;
    expect_serving_error("no pages", pa, e, FD_ERR_INVALID, "k");
    e = ps;
    e.block_table = 0;
    expect_serving_error("paged without block_table", pa, e, FD_ERR_INVALID, "block_table");
    e = ps;
    e.cache_batch = 3;
    e.cache_batch_idx = 0x9000000;
    expect_serving_error("paged with cache_batch_idx", pa, e, FD_ERR_INVALID, "cache_batch_idx");
    e = s;
    e.cache_batch_idx = 0x9000000;
    expect_serving_error("cache_batch_idx without cache_batch", a, e, FD_ERR_INVALID, "cache_batch_idx");
    e = s;
    e.cache_leftpad = 0x9000002;
    expect_serving_error("cache_leftpad misaligned", a, e, FD_ERR_INVALID, "cache_leftpad");
    e = s;
    e.window = 1;
    e.window_left = -2;
    expect_serving_error("window_size (-2, 0)", a, e, FD_ERR_INVALID, "window");
    e = s;
    e.softcap = -1;
    expect_serving_error("softcap -1", a, e, FD_ERR_INVALID, "softcap");
    e = s;
    e.alibi_slopes = 0x9000001;
    expect_serving_error("alibi_slopes misaligned", a, e, FD_ERR_INVALID, "alibi_slopes");
    e = as;
    e.k_new.seq_stride = 1020;
    expect_serving_error("k stride", a, e, FD_ERR_UNSUPPORTED, "k_new");
    e = as;
    e.v_new.ptr = 0;
    expect_serving_error("v null", a, e, FD_ERR_INVALID, "v_new");
    e = as;
    e.rotary_dim = 24;
    expect_serving_error("rotary_dim 24", a, e, FD_ERR_UNSUPPORTED, "rotary_dim");
    e = as;
    e.rotary_dim = 130;
    expect_serving_error("rotary_dim past head_dim", a, e, FD_ERR_INVALID, "rotary_dim");
    e = as;
    e.seqlen_new = 0;
    expect_serving_error("rotary without an append", a, e, FD_ERR_INVALID, "rotary_cos");
    fd_args b = a;
    b.cache_seqlens = 0;
    expect_serving_error("append without cache_seqlens", b, as, FD_ERR_INVALID, "seqlen");
}

// Without a device, every serving feature at once passes the checks and stops there.
static void test_serving_no_device(void) {
    fd_args a = serving_args();
    a.device = 0;
    fd_serving s;
    memset(&s, 0, sizeof s);
    appending(&s);
    s.cache_batch = 4;
    s.cache_batch_idx = 0x9000000;
    s.cache_leftpad = 0xa000000;
    s.window = 1;
    s.window_left = 300;
    s.window_right = -1;
    s.softcap = 30;
    s.alibi_slopes = 0xb000000;
    s.alibi_batch_stride = 32;
    int rc = fd_decode_serving(&a, &s, NULL, 0, NULL);
    CHECK(rc != FD_OK && strstr(fd_last_error(), "device"), "serving decode on missing device 0: %d \"%s\"", rc,
          fd_last_error());
}

// ---- decoding on a GPU ---------------------------------------------------------------

static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, mant = x & 0x7fffffu;
    int exp = (int)((x >> 23) & 0xff) - 127 + 15;
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u);  // inputs here are small: no NaN
    if (exp <= 0) {                                     // subnormal or zero
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        int shift = 14 - exp;
        uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13), rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, x;
    if (exp == 0) {
        float f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    x = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t to_bits(int dtype, float f) { return dtype == FD_FLOAT16 ? f32_to_f16(f) : f32_to_bf16(f); }
static float from_bits(int dtype, uint16_t h) { return dtype == FD_FLOAT16 ? f16_to_f32(h) : bf16_to_f32(h); }

static uint32_t rng;
static float uniform(void) {  // in [-1, 1)
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / 8388608.0f - 1.0f;
}

typedef struct gpu_case {
    const char *name;
    int dtype, batch, seqlen_q, heads_q, heads_kv, head_dim, seqlen_cache, seqlen;
    const int *lens;  // per-sequence lengths (cache_seqlens) or NULL
    int causal, num_splits, pad_rows;  // pad_rows: extra rows per sequence (strided cache)
    int refused;  // the library must refuse it as not supported (FD_ERR_UNSUPPORTED)
} gpu_case;

// case_length is sequence b's length, clamped to the cache as the library does.
static int case_length(const gpu_case *c, int b) {
    int len = c->lens ? c->lens[b] : (c->seqlen < 0 ? c->seqlen_cache : c->seqlen);
    return len < 0 ? 0 : (len > c->seqlen_cache ? c->seqlen_cache : len);
}

// make_inputs fills q, k and v with uniform values rounded to the dtype (their bits in hq, hk, hv),
// the same ones for every case of a shape. With plant, every row's largest score lies in the last
// tile and mid-sequence: a sequence's q rows of a K/V head take the signs of the first one, and keys
// len - 1, len - seqlen_q and len / 2 are those signs (+-1), so that a kernel that skips either's
// tile or split is far off.
static void make_inputs(const gpu_case *c, int64_t kvb, int plant, float *q, float *k, float *v, uint16_t *hq,
                        uint16_t *hk, uint16_t *hv) {
    int d = c->head_dim, g = c->heads_q / c->heads_kv;
    int64_t nq = (int64_t)c->batch * c->seqlen_q * c->heads_q * d, nkv = c->batch * kvb;
    rng = 12345;
    for (int64_t i = 0; i < nq; i++) q[i] = from_bits(c->dtype, hq[i] = to_bits(c->dtype, uniform()));
    for (int64_t i = 0; i < nkv; i++) k[i] = from_bits(c->dtype, hk[i] = to_bits(c->dtype, uniform()));
    for (int64_t i = 0; i < nkv; i++) v[i] = from_bits(c->dtype, hv[i] = to_bits(c->dtype, uniform()));
    for (int b = 0; plant && b < c->batch; b++) {
        int len = case_length(c, b), at[3] = {len - 1, len - c->seqlen_q, len / 2};
        for (int kvh = 0; kvh < c->heads_kv; kvh++) {
            const float *first = q + ((int64_t)b * c->seqlen_q * c->heads_q + kvh * g) * d;
            for (int i = 0; i < c->seqlen_q; i++) {
                for (int h = kvh * g; h < (kvh + 1) * g; h++) {
                    int64_t row = (((int64_t)b * c->seqlen_q + i) * c->heads_q + h) * d;
                    for (int e = 0; e < d; e++) hq[row + e] = to_bits(c->dtype, q[row + e] = copysignf(q[row + e], first[e]));
                }
            }
            for (int t = 0; t < 3; t++) {
                if (len == 0 || at[t] < 0) continue;
                int64_t key = b * kvb + ((int64_t)at[t] * c->heads_kv + kvh) * d;
                for (int e = 0; e < d; e++) hk[key + e] = to_bits(c->dtype, k[key + e] = copysignf(1.0f, first[e]));
            }
        }
    }
}

// reference computes out and lse in double for one case from the rounded inputs.
static void reference(const gpu_case *c, const float *q, const float *k, const float *v, int64_t kvb,
                      double *out, double *lse) {
    int g = c->heads_q / c->heads_kv, d = c->head_dim;
    double scale = 1.0 / sqrt((double)d);
    double *s = malloc(sizeof(double) * (c->seqlen_cache > 0 ? c->seqlen_cache : 1));
    for (int b = 0; b < c->batch; b++) {
        int len = case_length(c, b);
        for (int h = 0; h < c->heads_q; h++) {
            int hk = h / g;
            for (int i = 0; i < c->seqlen_q; i++) {
                int last = c->causal ? len - c->seqlen_q + i : len - 1;
                if (last > len - 1) last = len - 1;
                const float *qi = q + (((int64_t)b * c->seqlen_q + i) * c->heads_q + h) * d;
                double *o = out + (((int64_t)b * c->seqlen_q + i) * c->heads_q + h) * d;
                double *l = lse + ((int64_t)b * c->heads_q + h) * c->seqlen_q + i;
                memset(o, 0, sizeof(double) * d);
                if (last < 0) {
                    *l = -INFINITY;
                    continue;
                }
                double m = -INFINITY, sum = 0;
                for (int j = 0; j <= last; j++) {
                    const float *kj = k + b * kvb + ((int64_t)j * c->heads_kv + hk) * d;
                    double dot = 0;
                    for (int e = 0; e < d; e++) dot += (double)qi[e] * kj[e];
                    s[j] = dot * scale;
                    if (s[j] > m) m = s[j];
                }
                for (int j = 0; j <= last; j++) {
                    double p = exp(s[j] - m);
                    const float *vj = v + b * kvb + ((int64_t)j * c->heads_kv + hk) * d;
                    sum += p;
                    for (int e = 0; e < d; e++) o[e] += p * vj[e];
                }
                for (int e = 0; e < d; e++) o[e] /= sum;
                *l = m + log(sum);
            }
        }
    }
    free(s);
}

// compare counts the values of out (the dtype's bits) and lse off the reference by more than
// core/cuda's GPU tests allow (tolerance_test.go): an out element by 4 rounding steps of the dtype
// at its size plus its row's RMS, the lse (fp32 throughout) by 1e-4 of its size, at least 1. worst
// gets the largest error in units of its bound.
static int compare(const gpu_case *c, const uint16_t *hout, const float *glse, const double *rout, const double *rlse,
                   double *worst) {
    int d = c->head_dim, bad = 0;
    int64_t nq = (int64_t)c->batch * c->seqlen_q * c->heads_q * d, nlse = (int64_t)c->batch * c->heads_q * c->seqlen_q;
    double step = c->dtype == FD_FLOAT16 ? 0x1p-10 : 0x1p-7;
    *worst = 0;
    for (int64_t r = 0; r < nq; r += d) {
        double ss = 0;
        for (int e = 0; e < d; e++) ss += rout[r + e] * rout[r + e];
        double rms = sqrt(ss / d);
        for (int e = 0; e < d; e++) {
            double err = fabs(from_bits(c->dtype, hout[r + e]) - rout[r + e]);
            double ratio = err / (4 * step * (fabs(rout[r + e]) + rms) + 0x1p-24);
            if (!(ratio <= 1)) bad++;
            if (!(ratio <= *worst)) *worst = ratio;
        }
    }
    for (int64_t i = 0; i < nlse; i++) {
        if (isinf(rlse[i]) && isinf(glse[i]) && glse[i] < 0) continue;
        double ratio = fabs(glse[i] - rlse[i]) / (1e-4 * fmax(1, fabs(rlse[i])));
        if (!(ratio <= 1)) bad++;
        if (!(ratio <= *worst)) *worst = ratio;
    }
    return bad;
}

static void run_case(const gpu_case *c, CUstream stream) {
    int d = c->head_dim, rows = c->seqlen_cache + c->pad_rows;
    int64_t nq = (int64_t)c->batch * c->seqlen_q * c->heads_q * d;
    int64_t kvb = (int64_t)rows * c->heads_kv * d;  // batch stride of K/V (padded rows)
    int64_t nkv = c->batch * kvb, nlse = (int64_t)c->batch * c->heads_q * c->seqlen_q;
    float *q = malloc(sizeof(float) * nq), *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
    uint16_t *hq = malloc(2 * nq), *hk = malloc(2 * nkv), *hv = malloc(2 * nkv), *hout = malloc(2 * nq);
    float *glse = malloc(sizeof(float) * nlse);
    double *rout = malloc(sizeof(double) * nq), *rlse = malloc(sizeof(double) * nlse);
    CUdeviceptr dq = 0, dk = 0, dv = 0, dout = 0, dlse = 0, dlens = 0, dws = 0;
    make_inputs(c, kvb, 1, q, k, v, hq, hk, hv);

    CU(cuMemAlloc(&dq, 2 * nq));
    CU(cuMemAlloc(&dk, 2 * nkv));
    CU(cuMemAlloc(&dv, 2 * nkv));
    CU(cuMemAlloc(&dout, 2 * nq));
    CU(cuMemAlloc(&dlse, sizeof(float) * nlse));
    CU(cuMemcpyHtoD(dq, hq, 2 * nq));
    CU(cuMemcpyHtoD(dk, hk, 2 * nkv));
    CU(cuMemcpyHtoD(dv, hv, 2 * nkv));
    CU(cuMemsetD8(dout, 0xff, 2 * nq));  // NaN everywhere: every element must be written
    if (c->lens) {
        CU(cuMemAlloc(&dlens, sizeof(int) * c->batch));
        CU(cuMemcpyHtoD(dlens, c->lens, sizeof(int) * c->batch));
    }

    fd_args a;
    memset(&a, 0, sizeof a);
    a.dtype = c->dtype;
    a.batch = c->batch;
    a.seqlen_q = c->seqlen_q;
    a.heads_q = c->heads_q;
    a.heads_kv = c->heads_kv;
    a.head_dim = d;
    a.seqlen_cache = c->seqlen_cache;
    a.seqlen = c->seqlen;
    a.num_splits = c->num_splits;
    a.causal = c->causal;
    a.device = 0;
    a.q = (fd_tensor){dq, (int64_t)c->seqlen_q * c->heads_q * d, (int64_t)c->heads_q * d, d};
    a.k = (fd_tensor){dk, kvb, (int64_t)c->heads_kv * d, d};
    a.v = (fd_tensor){dv, kvb, (int64_t)c->heads_kv * d, d};
    a.out = a.q;
    a.out.ptr = dout;
    a.lse = dlse;
    a.cache_seqlens = dlens;

    size_t ws = 0;
    int rc = fd_workspace_size(&a, &ws);
    if (c->refused) {
        CHECK(rc == FD_ERR_UNSUPPORTED, "%s: fd_workspace_size returned %d, want not supported (%s)", c->name, rc,
              fd_last_error());
        goto done;
    }
    // Not supported counts as a failure: a build without kernels, or a GPU older than sm_80.
    CHECK(rc == FD_OK, "%s: fd_workspace_size: %d %s", c->name, rc, fd_last_error());
    if (rc != FD_OK) goto done;
    if (ws) CU(cuMemAlloc(&dws, ws));
    rc = fd_decode(&a, (void *)(uintptr_t)dws, ws, stream);
    CHECK(rc == FD_OK, "%s: fd_decode: %d %s", c->name, rc, fd_last_error());
    if (rc != FD_OK) goto done;
    if (ws > 0) {  // too small a workspace is refused, not overrun
        rc = fd_decode(&a, (void *)(uintptr_t)dws, ws - 1, stream);
        CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "workspace"), "%s: short workspace: %d %s", c->name,
              rc, fd_last_error());
    }
    CU(cuStreamSynchronize(stream));
    CU(cuMemcpyDtoH(hout, dout, 2 * nq));
    CU(cuMemcpyDtoH(glse, dlse, sizeof(float) * nlse));

    reference(c, q, k, v, kvb, rout, rlse);
    double worst;
    int bad = compare(c, hout, glse, rout, rlse, &worst);
    fd_plan_info p;
    fd_plan(&a, &p);
    CHECK(bad == 0, "%s: %d values out of bounds (worst %.3g x its bound)", c->name, bad, worst);
    printf("  %s: %s, %d split(s), worst error %.2g x its bound\n", c->name, p.kernel, p.num_splits, worst);
done:
    if (dq) cuMemFree(dq);
    if (dk) cuMemFree(dk);
    if (dv) cuMemFree(dv);
    if (dout) cuMemFree(dout);
    if (dlse) cuMemFree(dlse);
    if (dlens) cuMemFree(dlens);
    if (dws) cuMemFree(dws);
    free(q), free(k), free(v), free(hq), free(hk), free(hv), free(hout), free(glse), free(rout), free(rlse);
}

// The bounds of compare, without a GPU: on the "100 splits, 19999 keys" case (with fewer heads)
// they pass the reference rounded to the dtype and fail the answer of a kernel that skips the
// sequence's last key tile (64 keys at head dim 128), with planted keys or without.
static void test_bounds_see_a_dropped_tile(void) {
    static const int lens[] = {19999}, dropped[] = {19968};
    for (int plant = 0; plant < 2; plant++) {
        for (int dtype = FD_FLOAT16; dtype <= FD_BFLOAT16; dtype++) {
            gpu_case c = {"bounds", dtype, 1, 1, 16, 2, 128, 20000, -1, lens, 0, 100, 0, 0};
            int64_t nq = 16 * 128, nkv = 20000 * 2 * 128;
            float *q = malloc(sizeof(float) * nq), *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
            uint16_t *hq = malloc(2 * nq), *hk = malloc(2 * nkv), *hv = malloc(2 * nkv), *hout = malloc(2 * nq);
            double *rout = malloc(sizeof(double) * nq), *bout = malloc(sizeof(double) * nq), rlse[16], blse[16], worst;
            float glse[16];
            make_inputs(&c, nkv, plant, q, k, v, hq, hk, hv);
            reference(&c, q, k, v, nkv, rout, rlse);
            for (int64_t i = 0; i < nq; i++) hout[i] = to_bits(dtype, (float)rout[i]);
            for (int i = 0; i < 16; i++) glse[i] = (float)rlse[i];
            double correct;
            int bad = compare(&c, hout, glse, rout, rlse, &correct);
            CHECK(bad == 0, "dtype %d plant %d: the rounded reference is %d values off (worst %.3g x its bound)", dtype,
                  plant, bad, correct);
            gpu_case broken = c;
            broken.lens = dropped;
            reference(&broken, q, k, v, nkv, bout, blse);
            for (int64_t i = 0; i < nq; i++) hout[i] = to_bits(dtype, (float)bout[i]);
            for (int i = 0; i < 16; i++) glse[i] = (float)blse[i];
            bad = compare(&c, hout, glse, rout, rlse, &worst);
            CHECK(bad > 0, "dtype %d plant %d: the last tile dropped passes (worst %.3g x its bound)", dtype, plant, worst);
            printf("  bounds, dtype %d, planted %d: worst error %.2g x the bound, %.2g with the last tile dropped\n", dtype,
                   plant, correct, worst);
            free(q), free(k), free(v), free(hq), free(hk), free(hv), free(hout), free(rout), free(bout);
        }
    }
}

static void test_gpu(void) {
    static const int lens3[] = {0, 1, 200};
    static const int lens2[] = {4096, 1500};
    static const int lens1[] = {19999};
    const gpu_case cases[] = {
        {"f16 d128 mha", FD_FLOAT16, 2, 1, 8, 8, 128, 300, -1, NULL, 0, 0, 0, 0},
        {"f16 d64 gqa3 causal ragged sq4", FD_FLOAT16, 3, 4, 12, 4, 64, 257, -1, lens3, 1, 0, 5, 0},
        {"bf16 d256 mqa causal sq2 1 split", FD_BFLOAT16, 1, 2, 4, 1, 256, 1000, 999, NULL, 1, 1, 0, 0},
        {"f16 d128 gqa4 7 splits", FD_FLOAT16, 2, 1, 32, 8, 128, 4096, -1, lens2, 0, 7, 3, 0},
        {"bf16 d128 gqa5 sq16 causal", FD_BFLOAT16, 1, 16, 10, 2, 128, 777, -1, NULL, 1, 0, 0, 0},
        {"f16 d96 (padded variant)", FD_FLOAT16, 1, 1, 4, 2, 96, 500, -1, NULL, 0, 0, 0, 0},
        {"bf16 d64 gqa4 40 splits (combine kernel)", FD_BFLOAT16, 2, 1, 16, 4, 64, 5000, -1, lens2, 0, 40, 0, 0},
        {"bf16 d128 gqa8 100 splits, 19999 keys", FD_BFLOAT16, 1, 1, 64, 8, 128, 20000, -1, lens1, 0, 100, 0, 0},
        {"f16 d100 (not a multiple of 8)", FD_FLOAT16, 1, 1, 4, 2, 100, 300, -1, NULL, 0, 0, 0, 1},
    };
    CUdevice dev;
    CUcontext ctx = NULL;
    CUstream stream = NULL;
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], stream);
    // Also on the legacy default stream (NULL).
    run_case(&cases[0], NULL);
done:
    if (stream) cuStreamDestroy(stream);
    if (ctx) cuDevicePrimaryCtxRelease(dev);
}

int main(void) {
    test_version();
    test_plan();
    test_plan_json();
    test_errors();
    test_error_per_thread();
    test_serving_plan();
    test_serving_errors();
    test_bounds_see_a_dropped_tile();

    int devices = 0;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&devices) != CUDA_SUCCESS) devices = 0;
    if (devices > 0) {
        printf("GPU tests on %d device(s)\n", devices);
        test_gpu();
    } else {
        printf("no CUDA device: GPU tests skipped\n");
        test_no_device();
        test_serving_no_device();
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
