// prepare_test.c: the prepared API of libflashdecode.so (fd_prepare, fd_workspace_size,
// fd_run, fd_plan, fd_plan_json, fd_release) through its public header, without using a
// GPU (CI's stand-in libcuda.so.1 has none): fd_layout's fields against
// fd_layout_fields(), planning for device -1, refusals by name, handles, and that a
// forked child's call fails at once instead of hanging. fake_test.c runs fd_run on the
// fake device, decode_test.c computes on a GPU.
//
// Prints one line per failure and a closing "N passed, M failed"; exits 1 on failure.
#define _POSIX_C_SOURCE 200809L  // fork, waitpid, alarm, strtok_r under -std=c11
#include <cuda.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "flashdecode.h"
#include "check.h"

// dense_layout: b=2, 32/8 heads, d128, a contiguous cache of n keys, no window.
static fd_layout dense_layout(int64_t n) {
    fd_layout l;
    memset(&l, 0, sizeof l);
    l.dtype = FD_FLOAT16, l.batch = 2, l.seqlen_q = 1, l.heads_q = 32, l.heads_kv = 8, l.head_dim = 128;
    l.seqlen_cache = n, l.window_left = -1, l.window_right = -1;
    const int64_t q[4] = {32 * 128, 32 * 128, 128, 1}, kv[4] = {n * 8 * 128, 8 * 128, 128, 1};
    memcpy(l.q, q, sizeof q), memcpy(l.out, q, sizeof q);
    memcpy(l.k_cache, kv, sizeof kv), memcpy(l.v_cache, kv, sizeof kv);
    return l;
}

// good_ptrs: aligned, far apart, never dereferenced addresses for dense_layout(4096).
static fd_ptrs good_ptrs(void) {
    fd_ptrs p;
    memset(&p, 0, sizeof p);
    p.q = 0x1000000, p.out = 0x2000000, p.k_cache = 0x10000000, p.v_cache = 0x20000000;
    return p;
}

// expect_error checks that rc is want and fd_last_error names arg (": arg: ").
static void expect_error(const char *what, int rc, int want, const char *arg) {
    char needle[64];
    snprintf(needle, sizeof needle, ": %s: ", arg);
    CHECK(rc == want && strstr(fd_last_error(), needle), "%s: rc %d (want %d), \"%s\" (want %s)", what, rc, want,
          fd_last_error(), needle);
}

// A field of a record, as the test knows it from the header.
typedef struct field {
    const char *name;
    size_t offset, size;
} field;

#define FIELD(name) {#name, offsetof(fd_layout, name), sizeof(((fd_layout *)0)->name)}

// check_fields checks that every field text (fd_layout_fields() & co) names is where
// fields has it, of its kind (doubles: the float64 ones), and that together they are
// the whole record of size bytes.
static void check_fields(const char *what, const char *text, const field *fields, size_t nfields, size_t size,
                         const char *const *doubles) {
    char buf[8192];
    CHECK(strlen(text) < sizeof buf, "%s is %zu bytes", what, strlen(text));
    snprintf(buf, sizeof buf, "%s", text);
    size_t i = 0, n = 0;
    for (char *save = NULL, *f = strtok_r(buf, ",", &save); f; f = strtok_r(NULL, ",", &save), i++) {
        char *kind = strrchr(f, ':');
        CHECK(kind && (!strcmp(kind, ":q") || !strcmp(kind, ":d")), "%s field %zu: %s", what, i, f);
        if (!kind) continue;
        *kind++ = '\0';
        char *bracket = strchr(f, '[');
        size_t element = bracket ? (size_t)atoi(bracket + 1) : 0;
        if (bracket) *bracket = '\0';
        size_t j = 0;
        while (j < nfields && strcmp(fields[j].name, f)) j++;
        CHECK(j < nfields, "%s: no field %s", what, f);
        if (j == nfields) continue;
        CHECK(fields[j].offset + 8 * element == 8 * i && 8 * (element + 1) <= fields[j].size,
              "%s[%zu]: offset %zu, field %zu of %s", f, element, fields[j].offset + 8 * element, i, what);
        int is_double = 0;
        for (const char *const *d = doubles; *d; d++) is_double |= !strcmp(f, *d);
        CHECK(is_double == !strcmp(kind, "d"), "%s: kind %s", f, kind);
        n++;
    }
    CHECK(8 * i == size && n == i, "%s: %zu fields (%zu known) make %zu bytes; the struct has %zu", what, i, n, 8 * i,
          size);
}

// fd_layout's fields are fd_layout_fields()'s.
static void test_layout_fields(void) {
    static const field fields[] = {
        FIELD(dtype), FIELD(batch), FIELD(seqlen_q), FIELD(heads_q), FIELD(heads_kv), FIELD(head_dim),
        FIELD(seqlen_cache), FIELD(num_splits), FIELD(device_lengths), FIELD(causal), FIELD(scale), FIELD(q),
        FIELD(k_cache), FIELD(v_cache), FIELD(out), FIELD(page_size), FIELD(num_pages), FIELD(max_pages),
        FIELD(block_table), FIELD(cache_batch), FIELD(leftpad), FIELD(window_left), FIELD(window_right),
        FIELD(softcap), FIELD(alibi), FIELD(alibi_slopes), FIELD(seqlen_new), FIELD(k_new), FIELD(v_new),
        FIELD(rotary_dim), FIELD(rotary_rows), FIELD(rotary_cos), FIELD(rotary_sin), FIELD(rotary_interleaved),
        FIELD(kv_dtype), FIELD(descale), FIELD(k_descale), FIELD(v_descale), FIELD(k_descale_value),
        FIELD(v_descale_value), FIELD(sinks), FIELD(batch_invariant), FIELD(ragged), FIELD(total_q),
    };
    static const char *const doubles[] = {"scale", "softcap", "k_descale_value", "v_descale_value", NULL};
    check_fields("fd_layout_fields()", fd_layout_fields(), fields, sizeof fields / sizeof fields[0], sizeof(fd_layout),
                 doubles);
}

#define TFIELD(name) {#name, offsetof(fd_tensors, name), sizeof(((fd_tensors *)0)->name)}
#define DESC(t) TFIELD(t.given), TFIELD(t.dtype), TFIELD(t.device), TFIELD(t.rank), TFIELD(t.shape), TFIELD(t.strides)

// fd_tensors' fields are fd_tensors_fields()'s.
static void test_tensors_fields(void) {
    static const field fields[] = {
        DESC(q), DESC(k_cache), DESC(v_cache), DESC(k), DESC(v), DESC(rotary_cos), DESC(rotary_sin),
        DESC(cache_seqlens), DESC(cache_batch_idx), DESC(cache_leftpad), DESC(block_table), DESC(alibi_slopes),
        DESC(sinks), DESC(out), DESC(k_descale), DESC(v_descale), DESC(cu_seqlens_q),
        TFIELD(softmax_scale), TFIELD(causal), TFIELD(window_left), TFIELD(window_right), TFIELD(softcap),
        TFIELD(rotary_interleaved), TFIELD(num_splits), TFIELD(batch_invariant), TFIELD(max_seqlen_q),
        TFIELD(k_descale_value), TFIELD(v_descale_value),
    };
    static const char *const doubles[] = {"softmax_scale", "softcap", "k_descale_value", "v_descale_value", NULL};
    check_fields("fd_tensors_fields()", fd_tensors_fields(), fields, sizeof fields / sizeof fields[0],
                 sizeof(fd_tensors), doubles);
}

// desc4 describes a contiguous 4-D tensor of dtype on device.
static fd_tensor_desc desc4(int64_t dtype, int64_t device, int64_t a, int64_t b, int64_t c, int64_t d) {
    fd_tensor_desc t = {1, dtype, device, 4, {a, b, c, d}, {b * c * d, c * d, d, 1}};
    return t;
}

// fd_tensors_layout derives dense_layout's layout from tensors; fd_prepare_tensors
// prepares it on q's device and refuses by name what the tensors get wrong.
static void test_tensors(void) {
    fd_tensors t;
    memset(&t, 0, sizeof t);
    t.q = desc4(FD_FLOAT16, -1, 2, 1, 32, 128);
    t.k_cache = t.v_cache = desc4(FD_FLOAT16, -1, 2, 4096, 8, 128);
    t.window_left = t.window_right = -1;
    fd_layout got, want = dense_layout(4096);
    int rc = fd_tensors_layout(&t, sizeof t, &got, sizeof got);
    CHECK(rc == FD_OK && memcmp(&got, &want, sizeof got) == 0, "fd_tensors_layout: %d \"%s\"", rc, fd_last_error());
    fd_handle h = {0};
    expect_error("q off CUDA", fd_prepare_tensors(&t, sizeof t, &h), FD_ERR_INVALID, "q");
    fd_tensors bad = t;
    bad.k_cache.dtype = FD_BFLOAT16;
    expect_error("k_cache's dtype", fd_tensors_layout(&bad, sizeof bad, &got, sizeof got), FD_ERR_TYPE, "k_cache");
    bad = t, bad.v_cache.shape[1] = 4000;
    expect_error("v_cache's shape", fd_tensors_layout(&bad, sizeof bad, &got, sizeof got), FD_ERR_INVALID, "v_cache");
    bad = t, bad.cache_seqlens = (fd_tensor_desc){1, FD_INT64, -1, 1, {2}, {1}};
    expect_error("int64 lengths", fd_tensors_layout(&bad, sizeof bad, &got, sizeof got), FD_ERR_TYPE, "cache_seqlens");
    expect_error("NULL tensors", fd_prepare_tensors(NULL, sizeof t, &h), FD_ERR_INVALID, "tensors");
    expect_error("layout_size", fd_tensors_layout(&t, sizeof t, &got, 8), FD_ERR_INVALID, "layout_size");
}

// Without a GPU, device -1 plans for an H200: fd_plan, fd_plan_json and
// fd_workspace_size answer, fd_run is refused naming the device.
static void test_plan_without_gpu(void) {
    fd_layout l = dense_layout(4096);
    fd_handle h = {0};
    int rc = fd_prepare(&l, sizeof l, -1, &h);
    CHECK(rc == FD_OK && h.id != 0 && fd_last_error()[0] == '\0', "fd_prepare: %d \"%s\"", rc, fd_last_error());
    fd_plan_info p;
    size_t bytes = 1;
    rc = fd_plan(h, -1, &p);
    CHECK(rc == FD_OK && p.kernel[0] && p.sms == 132 && p.num_splits >= 1, "fd_plan: %d %s, %d SMs", rc, p.kernel, p.sms);
    CHECK(fd_workspace_size(h, -1, &bytes) == FD_OK && bytes == (size_t)p.workspace_bytes,
          "fd_workspace_size %zu, plan %lld", bytes, (long long)p.workspace_bytes);
    // The prepared plan is the one-shot call's for the same shapes.
    fd_args a;
    memset(&a, 0, sizeof a);
    a.dtype = FD_FLOAT16, a.batch = 2, a.seqlen_q = 1, a.heads_q = 32, a.heads_kv = 8, a.head_dim = 128;
    a.seqlen_cache = 4096, a.seqlen = 1000, a.device = -1;
    fd_plan_info q;
    rc = fd_plan(h, 1000, &p);
    CHECK(rc == FD_OK && fd_plan(&a, &q) == FD_OK && memcmp(&p, &q, sizeof p) == 0, "fd_plan(h, 1000) %s %d splits, "
          "fd_plan(args) %s %d splits", p.kernel, p.num_splits, q.kernel, q.num_splits);
    size_t needed = 0;
    rc = fd_plan_json(h, 1000, NULL, 0, &needed);
    CHECK(rc == FD_ERR_BUFFER && needed > 2, "fd_plan_json size: %d, %zu", rc, needed);
    char json[8192];
    rc = fd_plan_json(h, 1000, json, sizeof json, NULL);
    CHECK(rc == FD_OK && json[0] == '{' && strstr(json, p.kernel), "fd_plan_json: %d %s", rc, json);

    expect_error("seqlen past the cache", fd_workspace_size(h, 4097, &bytes), FD_ERR_INVALID, "seqlen");
    expect_error("seqlen -2", fd_plan(h, -2, &p), FD_ERR_INVALID, "seqlen");
    expect_error("NULL bytes", fd_workspace_size(h, -1, NULL), FD_ERR_INVALID, "bytes");
    fd_ptrs ptrs = good_ptrs();
    expect_error("fd_run without a device", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID, "device");
    CHECK(fd_release(h) == FD_OK, "fd_release: \"%s\"", fd_last_error());
}

// With device lengths, seqlen is a bound the library rounds up to a power of two.
static void test_bound(void) {
    fd_layout l = dense_layout(4096);
    l.device_lengths = 1;
    fd_handle h;
    CHECK(fd_prepare(&l, sizeof l, -1, &h) == FD_OK, "fd_prepare: \"%s\"", fd_last_error());
    char a[8192], b[8192];
    int rc = fd_plan_json(h, 700, a, sizeof a, NULL);
    CHECK(rc == FD_OK && fd_plan_json(h, 1024, b, sizeof b, NULL) == FD_OK && !strcmp(a, b),
          "bounds 700 and 1024 plan alike: %d\n%s\n%s", rc, a, b);
    expect_error("a negative bound", fd_plan_json(h, -5, a, sizeof a, NULL), FD_ERR_INVALID, "seqlen");
    fd_release(h);
}

// The same layout gets the same handle while held; each fd_release holds it once less.
static void test_handles(void) {
    fd_layout l = dense_layout(4096);
    fd_handle a, b, c;
    CHECK(fd_prepare(&l, sizeof l, -1, &a) == FD_OK && fd_prepare(&l, sizeof l, -1, &b) == FD_OK && a.id == b.id,
          "the same layout: %lld, %lld", (long long)a.id, (long long)b.id);
    l.causal = 1;
    CHECK(fd_prepare(&l, sizeof l, -1, &c) == FD_OK && c.id != a.id, "another layout: %lld", (long long)c.id);
    // torch's strides of a size-1 dimension are anything: the same layout.
    fd_layout odd = dense_layout(4096);
    odd.q[1] = 3, odd.out[1] = 5;
    CHECK(fd_prepare(&odd, sizeof odd, -1, &b) == FD_OK && b.id == a.id, "size-1 strides: %lld, want %lld \"%s\"",
          (long long)b.id, (long long)a.id, fd_last_error());
    for (int i = 0; i < 3; i++) CHECK(fd_release(a) == FD_OK, "release %d: \"%s\"", i, fd_last_error());
    size_t bytes;
    expect_error("a released handle", fd_workspace_size(a, -1, &bytes), FD_ERR_INVALID, "handle");
    expect_error("release again", fd_release(a), FD_ERR_INVALID, "handle");
    expect_error("a zero handle", fd_release((fd_handle){0}), FD_ERR_INVALID, "handle");
    CHECK(fd_release(c) == FD_OK, "release c");
}

static void test_prepare_refusals(void) {
    fd_handle h = {0};
    fd_layout l = dense_layout(4096);
    l.heads_q = 12;
    expect_error("heads 12/8", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "heads_q");
    l = dense_layout(4096), l.head_dim = 100;
    expect_error("head_dim 100", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_UNSUPPORTED, "head_dim");
    l = dense_layout(4096), l.k_cache[3] = 2;
    expect_error("k_cache's last stride", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "k_cache");
    l = dense_layout(4096), l.scale = -1;
    expect_error("scale -1", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "scale");
    l = dense_layout(4096), l.causal = 2;
    expect_error("causal 2", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "causal");
    l = dense_layout(4096), l.window_left = l.window_right = 0;  // a zeroed window is (0, 0): valid
    CHECK(fd_prepare(&l, sizeof l, -1, &h) == FD_OK && fd_release(h) == FD_OK, "window (0, 0): \"%s\"", fd_last_error());
    l = dense_layout(4096);
    expect_error("NULL layout", fd_prepare(NULL, sizeof l, -1, &h), FD_ERR_INVALID, "layout");
    expect_error("NULL out", fd_prepare(&l, sizeof l, -1, NULL), FD_ERR_INVALID, "out");
    expect_error("device 999", fd_prepare(&l, sizeof l, 999, &h), FD_ERR_INVALID, "device");
    expect_error("a part of a field", fd_prepare(&l, 13, -1, &h), FD_ERR_INVALID, "layout_size");
    // A newer caller's longer record: its extra fields must be 0.
    struct {
        fd_layout l;
        int64_t newer;
    } grown = {dense_layout(4096), 0};
    CHECK(fd_prepare(&grown.l, sizeof grown, -1, &h) == FD_OK && fd_release(h) == FD_OK, "a longer record of zeros: \"%s\"",
          fd_last_error());
    grown.newer = 1;
    expect_error("a newer field set", fd_prepare(&grown.l, sizeof grown, -1, &h), FD_ERR_UNSUPPORTED, "layout_size");
    // An older caller's shorter record: the fields it lacks are 0.
    CHECK(fd_prepare(&l, offsetof(fd_layout, rotary_interleaved), -1, &h) == FD_OK && fd_release(h) == FD_OK,
          "a shorter record: \"%s\"", fd_last_error());
}

// An fp8 layout plans without a GPU, with descale arrays or values; descales of a
// float16 cache, another dtype for the caches and a call without the arrays the
// layout has are refused by name.
static void test_fp8(void) {
    fd_layout l = dense_layout(4096);
    l.kv_dtype = FD_FLOAT8_E4M3, l.descale = 1;
    l.k_descale[0] = 8, l.k_descale[1] = 1;  // (batch, heads_kv); v_descale's 0, 0: one scale
    fd_handle h;
    CHECK(fd_prepare(&l, sizeof l, -1, &h) == FD_OK, "fd_prepare e4m3: \"%s\"", fd_last_error());
    fd_plan_info p;
    int rc = fd_plan(h, 1000, &p);
    CHECK(rc == FD_OK && p.kernel[0] && p.num_splits >= 1, "fd_plan e4m3: %d %s \"%s\"", rc, p.kernel, fd_last_error());
    char json[8192];
    rc = fd_plan_json(h, 1000, json, sizeof json, NULL);
    CHECK(rc == FD_OK && strstr(json, p.kernel), "fd_plan_json e4m3: %d %s", rc, json);
    fd_release(h);

    l = dense_layout(4096);
    l.dtype = FD_BFLOAT16, l.kv_dtype = FD_FLOAT8_E5M2, l.k_descale_value = 0.5, l.v_descale_value = 2;
    CHECK(fd_prepare(&l, sizeof l, -1, &h) == FD_OK && fd_plan(h, -1, &p) == FD_OK && fd_release(h) == FD_OK,
          "e5m2 with values: \"%s\"", fd_last_error());

    l = dense_layout(4096), l.k_descale_value = 2;
    expect_error("a descale of a float16 cache", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "k_descale");
    l = dense_layout(4096), l.kv_dtype = FD_BFLOAT16;
    expect_error("bfloat16 caches for float16", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_UNSUPPORTED, "kv_dtype");
    l = dense_layout(4096), l.kv_dtype = FD_FLOAT8_E4M3, l.v_descale_value = -1;
    expect_error("a negative descale", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_INVALID, "v_descale");
    l = dense_layout(4096), l.dtype = FD_FLOAT8_E4M3;
    expect_error("an fp8 q", fd_prepare(&l, sizeof l, -1, &h), FD_ERR_UNSUPPORTED, "dtype");

    l = dense_layout(4096), l.kv_dtype = FD_FLOAT8_E4M3, l.descale = 1;
    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare on device 0: \"%s\"", fd_last_error());
    fd_ptrs ptrs = good_ptrs();
    ptrs.v_descale = 0x3000000;
    expect_error("no k_descale", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID, "k_descale");
    fd_release(h);
}

// fd_run's checks before any device work. Without a GPU, a call with good (made-up)
// addresses gets as far as the missing device; with one, it is not made (it would launch).
static void test_run_refusals(int gpus) {
    fd_layout l = dense_layout(4096);
    fd_handle h;
    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare on device 0: \"%s\"", fd_last_error());
    fd_ptrs p = good_ptrs();
    size_t bytes;
    if (gpus == 0) {
        expect_error("good addresses, no device", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "device");
        expect_error("fd_workspace_size, no device", fd_workspace_size(h, -1, &bytes), FD_ERR_INVALID, "device");
    } else {
        CHECK(fd_workspace_size(h, -1, &bytes) == FD_OK, "fd_workspace_size on device 0: \"%s\"", fd_last_error());
    }
    p.q = 0;
    expect_error("NULL q", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "q");
    p = good_ptrs(), p.q = 16;  // 16-byte aligned, but no device address
    expect_error("q at 16", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "q");
    p = good_ptrs(), p.v_cache += 8;
    expect_error("misaligned v_cache", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_UNSUPPORTED, "v_cache");
    p = good_ptrs(), p.block_table = 0x3000000;
    expect_error("block_table without pages", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID,
                 "block_table");
    p = good_ptrs();
    expect_error("seqlen past the cache", fd_run(h, &p, sizeof p, 5000, NULL, 0, NULL), FD_ERR_INVALID, "seqlen");
    expect_error("workspace at 64", fd_run(h, &p, sizeof p, -1, (void *)64, 0, NULL), FD_ERR_INVALID, "workspace");
    expect_error("NULL ptrs", fd_run(h, NULL, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "ptrs");
    expect_error("ptrs_size 12", fd_run(h, &p, 12, -1, NULL, 0, NULL), FD_ERR_INVALID, "ptrs_size");
    fd_release(h);

    l.device_lengths = 1;
    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare: \"%s\"", fd_last_error());
    expect_error("device lengths without cache_seqlens", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID,
                 "cache_seqlens");
    fd_release(h);

    // Sinks: given exactly with the layout's sinks.
    l.device_lengths = 0;
    p = good_ptrs(), p.sinks = 0x3000000;
    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare: \"%s\"", fd_last_error());
    expect_error("sinks without the layout's", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "sinks");
    fd_release(h);
    l.sinks = 1;
    p.sinks = 0;
    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare with sinks: \"%s\"", fd_last_error());
    expect_error("NULL sinks", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "sinks");
    p.sinks = 0x3000002;
    expect_error("misaligned sinks", fd_run(h, &p, sizeof p, -1, NULL, 0, NULL), FD_ERR_INVALID, "sinks");
    fd_release(h);
}

// Ragged query lengths: the layout's ragged and total_q (q's batch stride not read),
// planned as the uniform layout of seqlen_q (max_seqlen_q) rows a sequence; refusals
// by name; fd_run takes cu_seqlens_q exactly with ragged.
static void test_ragged(int gpus) {
    fd_layout u = dense_layout(4096);
    u.seqlen_q = 4;
    const int64_t q4[4] = {4 * 32 * 128, 32 * 128, 128, 1};
    memcpy(u.q, q4, sizeof q4), memcpy(u.out, q4, sizeof q4);
    fd_layout l = u;
    l.ragged = 1, l.total_q = 5, l.q[0] = 12345, l.out[0] = 0;
    fd_handle hu, h;
    fd_plan_info pu, p;
    size_t wu = 0, w = 1;
    CHECK(fd_prepare(&u, sizeof u, -1, &hu) == FD_OK && fd_prepare(&l, sizeof l, -1, &h) == FD_OK,
          "fd_prepare: \"%s\"", fd_last_error());
    CHECK(fd_plan(hu, -1, &pu) == FD_OK && fd_plan(h, -1, &p) == FD_OK && memcmp(&p, &pu, sizeof p) == 0 &&
              fd_workspace_size(hu, -1, &wu) == FD_OK && fd_workspace_size(h, -1, &w) == FD_OK && w == wu,
          "ragged plan %s %d splits %zu bytes, uniform %s %d splits %zu bytes", p.kernel, p.num_splits, w, pu.kernel,
          pu.num_splits, wu);
    fd_release(hu), fd_release(h);

    fd_layout bad = l;
    bad.seqlen_q = 17;
    expect_error("max_seqlen_q 17", fd_prepare(&bad, sizeof bad, -1, &h), FD_ERR_UNSUPPORTED, "seqlen_q");
    bad = l, bad.total_q = 0;
    expect_error("total_q 0", fd_prepare(&bad, sizeof bad, -1, &h), FD_ERR_INVALID, "total_q");
    bad = u, bad.total_q = 5;
    expect_error("total_q without ragged", fd_prepare(&bad, sizeof bad, -1, &h), FD_ERR_INVALID, "total_q");
    bad = l, bad.ragged = 2;
    expect_error("ragged 2", fd_prepare(&bad, sizeof bad, -1, &h), FD_ERR_INVALID, "ragged");
    bad = l, bad.seqlen_new = 2;
    const int64_t kn[4] = {0, 8 * 128, 128, 1};
    memcpy(bad.k_new, kn, sizeof kn), memcpy(bad.v_new, kn, sizeof kn);
    expect_error("seqlen_new not seqlen_q", fd_prepare(&bad, sizeof bad, -1, &h), FD_ERR_INVALID, "k_new");

    CHECK(fd_prepare(&l, sizeof l, 0, &h) == FD_OK, "fd_prepare on device 0: \"%s\"", fd_last_error());
    fd_ptrs ptrs = good_ptrs();
    expect_error("no cu_seqlens_q", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID, "cu_seqlens_q");
    ptrs.cu_seqlens_q = 0x3000002;
    expect_error("misaligned cu_seqlens_q", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID,
                 "cu_seqlens_q");
    ptrs.cu_seqlens_q = 0x3000000, ptrs.lse = 0x1000000 + 4 * 128;  // inside q's 5 rows
    expect_error("lse over q", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID, "lse");
    ptrs.lse = 0;
    if (gpus == 0)
        expect_error("good ragged call, no device", fd_run(h, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID,
                     "device");
    fd_release(h);
    CHECK(fd_prepare(&u, sizeof u, 0, &hu) == FD_OK, "fd_prepare: \"%s\"", fd_last_error());
    expect_error("cu_seqlens_q without ragged", fd_run(hu, &ptrs, sizeof ptrs, -1, NULL, 0, NULL), FD_ERR_INVALID,
                 "cu_seqlens_q");
    fd_release(hu);
}

// A child forked without exec gets FD_ERR_FORKED at once, from every entry point,
// and a message that says to spawn; the parent keeps working.
static void test_fork(void) {
    fd_layout l = dense_layout(4096);
    fd_handle h;
    CHECK(fd_prepare(&l, sizeof l, -1, &h) == FD_OK, "fd_prepare: \"%s\"", fd_last_error());
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);  // a hang ends the child with SIGALRM
        fd_plan_info p;
        size_t bytes;
        fd_args a;
        memset(&a, 0, sizeof a);
        int ok = fd_plan(h, -1, &p) == FD_ERR_FORKED && strstr(fd_last_error(), "spawn") &&
                 fd_prepare(&l, sizeof l, -1, &h) == FD_ERR_FORKED && fd_workspace_size(h, -1, &bytes) == FD_ERR_FORKED &&
                 fd_decode(&a, NULL, 0, NULL) == FD_ERR_FORKED && fd_merge_states(NULL, NULL) == FD_ERR_FORKED &&
                 fd_release(h) == FD_ERR_FORKED && fd_version()[0] != '\0';
        if (!ok) fprintf(stderr, "forked child: \"%s\"\n", fd_last_error());
        _exit(ok ? 0 : 1);
    }
    CHECK(pid > 0, "fork");
    if (pid <= 0) return;
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "forked child: %s %d", WIFSIGNALED(st) ? "signal" : "exit",
          WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    fd_plan_info p;
    CHECK(fd_plan(h, -1, &p) == FD_OK, "the parent after fork: \"%s\"", fd_last_error());
    fd_release(h);
}

int main(void) {
    int gpus = 0;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&gpus) != CUDA_SUCCESS) gpus = 0;
    // fd_version first: the fork test reads it in the child, from the parent's copy.
    const char *v = fd_version();
    CHECK(v && v[0] >= '0' && v[0] <= '9', "fd_version() = \"%s\"", v ? v : "(null)");
    test_layout_fields();
    test_tensors_fields();
    test_tensors();
    test_plan_without_gpu();
    test_bound();
    test_handles();
    test_prepare_refusals();
    test_run_refusals(gpus);
    test_fp8();
    test_ragged(gpus);
    test_fork();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
