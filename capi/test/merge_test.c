// merge_test.c: tests fd_merge_states of libflashdecode.so through its public header.
//
// Without a GPU (CI, with the stand-in libcuda.so.1 of tests/fakecuda) it checks that bad
// arguments are refused with the right code and an fd_last_error naming the argument,
// before any device work, and that a good merge on a missing device fails cleanly. With
// a GPU it also merges float32 states in device memory and compares with a CPU merge in
// double precision. Built and run by capi/test/run.sh like decode_test.c.
//
// Prints one line per failure and a closing "N passed, M failed"; exits 1 on failure.
#include <cuda.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashdecode.h"
#include "check.h"


// ---- argument checks: no GPU needed ---------------------------------------------------

// valid_args: 3 float32 states, one pointer each, of (2, 3, 4) rows of head_dim 64, out and
// lse contiguous, at made-up 256-byte aligned addresses on device 0.
static fd_merge_args valid_args(void) {
    fd_merge_args a;
    memset(&a, 0, sizeof a);
    a.dtype = FD_FLOAT32;
    a.num_states = 3;
    a.rows[0] = 2, a.rows[1] = 3, a.rows[2] = 4;
    a.head_dim = 64;
    a.device = 0;
    a.outs.num_ptrs = 3;
    a.lses.num_ptrs = 3;
    for (int s = 0; s < 3; s++) {
        a.outs.ptrs[s] = 0x100000u * (uint64_t)(s + 1);
        a.lses.ptrs[s] = 0x800000u + 0x1000u * (uint64_t)s;
    }
    a.outs.row_strides[0] = 3 * 4 * 64, a.outs.row_strides[1] = 4 * 64, a.outs.row_strides[2] = 64;
    a.lses.row_strides[0] = 12, a.lses.row_strides[1] = 4, a.lses.row_strides[2] = 1;
    a.out = 0x1000000u;
    memcpy(a.out_strides, a.outs.row_strides, sizeof a.out_strides);
    a.lse = 0x2000000u;
    memcpy(a.lse_strides, a.lses.row_strides, sizeof a.lse_strides);
    return a;
}

static void expect_error(const char *what, fd_merge_args a, int code, const char *word) {
    int rc = fd_merge_states(&a, NULL);
    CHECK(rc == code, "%s: fd_merge_states returned %d, want %d (%s)", what, rc, code, fd_last_error());
    CHECK(strstr(fd_last_error(), word) != NULL, "%s: fd_last_error \"%s\" lacks \"%s\"", what, fd_last_error(),
          word);
}

static void test_errors(void) {
    fd_merge_args a;
    int rc = fd_merge_states(NULL, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "args"), "fd_merge_states(NULL): %d \"%s\"", rc,
          fd_last_error());

    a = valid_args(), a.dtype = 7;
    expect_error("dtype 7", a, FD_ERR_UNSUPPORTED, "dtype");
    a = valid_args(), a.num_states = 0;
    expect_error("no states", a, FD_ERR_INVALID, "num_states");
    a = valid_args(), a.rows[1] = 0;
    expect_error("a row size 0", a, FD_ERR_INVALID, "rows");
    a = valid_args(), a.head_dim = 6;
    expect_error("head_dim 6", a, FD_ERR_UNSUPPORTED, "headdim");
    a = valid_args(), a.head_dim = 260;
    expect_error("head_dim 260", a, FD_ERR_UNSUPPORTED, "headdim");
    a = valid_args(), a.outs.num_ptrs = 2;
    expect_error("2 pointers for 3 states", a, FD_ERR_INVALID, "outs");
    a = valid_args(), a.outs.num_ptrs = 9, a.num_states = 9;
    expect_error("9 pointers", a, FD_ERR_INVALID, "outs");
    a = valid_args(), a.outs.ptrs[2] = 0;
    expect_error("a null state", a, FD_ERR_INVALID, "state 2");
    a = valid_args(), a.outs.ptrs[0] += 8;
    expect_error("outs 8-byte aligned (float32)", a, FD_ERR_UNSUPPORTED, "outs");
    a = valid_args(), a.outs.row_strides[1] = 258;
    expect_error("outs stride not a multiple of 4", a, FD_ERR_UNSUPPORTED, "outs");
    a = valid_args(), a.lses.ptrs[1] += 2;
    expect_error("lses misaligned", a, FD_ERR_INVALID, "lses");
    a = valid_args(), a.lses.row_strides[2] = -1;
    expect_error("lses negative stride", a, FD_ERR_INVALID, "lses");
    a = valid_args(), a.out = 0;
    expect_error("out NULL", a, FD_ERR_INVALID, "out");
    a = valid_args(), a.out_strides[2] = 32;
    expect_error("out rows overlap", a, FD_ERR_INVALID, "out");
    a = valid_args(), a.lse_strides[0] = 0;
    expect_error("lse rows overlap", a, FD_ERR_INVALID, "lse");
    a = valid_args(), a.out = a.outs.ptrs[1] + 256;
    expect_error("out inside a state's outs", a, FD_ERR_INVALID, "out: invalid argument: shares memory with outs");
    a = valid_args(), a.lse = a.lses.ptrs[0];
    expect_error("lse on a state's lses", a, FD_ERR_INVALID, "lse: invalid argument: shares memory with lses");
    a = valid_args(), a.device = -1;
    expect_error("device -1", a, FD_ERR_INVALID, "device");

    // A stacked tensor with a state stride and no lse output is well-formed: on a
    // machine without a device it fails there, not in the checks.
    a = valid_args();
    a.outs.num_ptrs = 1, a.outs.state_stride = 2 * 3 * 4 * 64;
    a.lses.num_ptrs = 1, a.lses.state_stride = 2 * 3 * 4;
    a.lse = 0;
    a.device = 999;
    rc = fd_merge_states(&a, NULL);
    CHECK(rc != FD_OK && strstr(fd_last_error(), "device"), "merge on device 999: %d \"%s\"", rc, fd_last_error());
}

// ---- merging on a GPU -----------------------------------------------------------------

static uint32_t rng = 4242;
static float uniform(void) {  // in [-1, 1)
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / 8388608.0f - 1.0f;
}

// run_case merges n float32 states of rows r0 x r1 x r2 of head_dim d: outs one pointer per
// state (list) or stacked, lses stacked with their last two row dimensions swapped. State 1
// is empty in every row (lse -inf, out NaN) and row 0 is empty in every state.
static void run_case(const char *name, int n, int r0, int r1, int r2, int d, int list, int want_lse,
                     CUstream stream) {
    int rows = r0 * r1 * r2;
    float *outs = malloc(sizeof(float) * n * rows * d), *lses = malloc(sizeof(float) * n * rows);
    float *got = malloc(sizeof(float) * rows * d), *got_lse = malloc(sizeof(float) * rows);
    CUdeviceptr douts[FD_MERGE_MAX_POINTERS] = {0}, dlses = 0, dout = 0, dlse = 0;
    for (int i = 0; i < n * rows * d; i++) outs[i] = uniform();
    // lses[s][i0][i2][i1]: the row (i0, i1, i2) of state s.
    for (int s = 0; s < n; s++)
        for (int i = 0; i < rows; i++) {
            int i0 = i / (r1 * r2), i1 = i / r2 % r1, i2 = i % r2;
            float x = 8 * uniform();
            if (i == 0 || (s == 1 && n > 1)) {
                x = -INFINITY;
                if (s == 1) memset(outs + ((size_t)s * rows + i) * d, 0xff, sizeof(float) * d);  // NaN
            }
            lses[(size_t)s * rows + (size_t)i0 * r1 * r2 + (size_t)i2 * r1 + i1] = x;
        }

    fd_merge_args a;
    memset(&a, 0, sizeof a);
    a.dtype = FD_FLOAT32;
    a.num_states = n;
    a.rows[0] = r0, a.rows[1] = r1, a.rows[2] = r2;
    a.head_dim = d;
    a.device = 0;
    a.outs.row_strides[0] = (int64_t)r1 * r2 * d, a.outs.row_strides[1] = (int64_t)r2 * d, a.outs.row_strides[2] = d;
    if (list) {
        a.outs.num_ptrs = n;
        for (int s = 0; s < n; s++) {
            CU(cuMemAlloc(&douts[s], sizeof(float) * rows * d));
            CU(cuMemcpyHtoD(douts[s], outs + (size_t)s * rows * d, sizeof(float) * rows * d));
            a.outs.ptrs[s] = douts[s];
        }
    } else {
        CU(cuMemAlloc(&douts[0], sizeof(float) * n * rows * d));
        CU(cuMemcpyHtoD(douts[0], outs, sizeof(float) * n * rows * d));
        a.outs.num_ptrs = 1, a.outs.ptrs[0] = douts[0], a.outs.state_stride = (int64_t)rows * d;
    }
    CU(cuMemAlloc(&dlses, sizeof(float) * n * rows));
    CU(cuMemcpyHtoD(dlses, lses, sizeof(float) * n * rows));
    a.lses.num_ptrs = 1, a.lses.ptrs[0] = dlses, a.lses.state_stride = rows;
    a.lses.row_strides[0] = (int64_t)r1 * r2, a.lses.row_strides[1] = 1, a.lses.row_strides[2] = r1;
    CU(cuMemAlloc(&dout, sizeof(float) * rows * d));
    CU(cuMemsetD8(dout, 0xff, sizeof(float) * rows * d));  // NaN: every element must be written
    a.out = dout;
    memcpy(a.out_strides, a.outs.row_strides, sizeof a.out_strides);
    if (want_lse) {
        CU(cuMemAlloc(&dlse, sizeof(float) * rows));
        a.lse = dlse;
        a.lse_strides[0] = (int64_t)r1 * r2, a.lse_strides[1] = r2, a.lse_strides[2] = 1;
    }
    int rc = fd_merge_states(&a, stream);
    CHECK(rc == FD_OK, "%s: fd_merge_states: %d %s", name, rc, fd_last_error());
    if (rc != FD_OK) goto done;
    CU(cuStreamSynchronize(stream));
    CU(cuMemcpyDtoH(got, dout, sizeof(float) * rows * d));
    if (want_lse) CU(cuMemcpyDtoH(got_lse, dlse, sizeof(float) * rows));

    int bad = 0;
    double worst = 0;
    for (int i = 0; i < rows; i++) {
        int i0 = i / (r1 * r2), i1 = i / r2 % r1, i2 = i % r2;
        double m = -INFINITY, sum = 0;
        for (int s = 0; s < n; s++) {
            double x = lses[(size_t)s * rows + (size_t)i0 * r1 * r2 + (size_t)i2 * r1 + i1];
            if (x > m) m = x;
        }
        for (int e = 0; e < d; e++) {
            double o = 0;
            sum = 0;
            for (int s = 0; s < n && !isinf(m); s++) {
                double w = exp(lses[(size_t)s * rows + (size_t)i0 * r1 * r2 + (size_t)i2 * r1 + i1] - m);
                if (w == 0) continue;
                sum += w;
                o += w * outs[((size_t)s * rows + i) * d + e];
            }
            double want = sum > 0 ? o / sum : 0, err = fabs(got[(size_t)i * d + e] - want);
            if (!(err <= 1e-5)) bad++;
            if (err > worst || isnan(err)) worst = err;
        }
        if (want_lse) {
            double want = isinf(m) ? -INFINITY : m + log(sum);
            if (isinf(want) ? !(isinf(got_lse[i]) && got_lse[i] < 0) : !(fabs(got_lse[i] - want) <= 1e-5 * (1 + fabs(want))))
                bad++;
        }
    }
    CHECK(bad == 0, "%s: %d mismatches (worst |out err| %.3g)", name, bad, worst);
    printf("  %s: max |out err| %.2g\n", name, worst);
done:
    for (int s = 0; s < FD_MERGE_MAX_POINTERS; s++)
        if (douts[s]) cuMemFree(douts[s]);
    if (dlses) cuMemFree(dlses);
    if (dout) cuMemFree(dout);
    if (dlse) cuMemFree(dlse);
    free(outs), free(lses), free(got), free(got_lse);
}

// ---- fd_merge_tensors: the states as a framework holds them -----------------------------

// tensor: a contiguous tensor of shape on device 0 at data.
static fd_merge_tensor tensor(int64_t dtype, uint64_t data, int rank, const int64_t *shape) {
    fd_merge_tensor t;
    memset(&t, 0, sizeof t);
    t.desc.given = 1, t.desc.dtype = dtype, t.desc.rank = rank, t.data = data;
    int64_t step = 1;
    for (int i = rank - 1; i >= 0; i--) t.desc.shape[i] = shape[i], t.desc.strides[i] = step, step *= shape[i];
    return t;
}

static void test_tensors(void) {
    CHECK(sizeof(fd_merge_tensor) == 8 * (4 + 2 * 8 + 1), "sizeof(fd_merge_tensor) = %zu", sizeof(fd_merge_tensor));
    // Two float16 states (2, 3, 64) stacked, lses a list of two (2, 3), out and lse.
    const int64_t outs[] = {2, 2, 3, 64}, rows[] = {2, 3};
    fd_merge_tensor t[5] = {tensor(FD_FLOAT16, 0x100000u, 4, outs), tensor(FD_FLOAT32, 0x200000u, 2, rows),
                            tensor(FD_FLOAT32, 0x300000u, 2, rows), tensor(FD_FLOAT16, 0x400000u, 3, outs + 1),
                            tensor(FD_FLOAT32, 0x500000u, 2, rows)};
    int rc = fd_merge_tensors(t, sizeof t, 1, 2, FD_MERGE_OUTS_STACKED, NULL);
    CHECK(rc != FD_OK && strstr(fd_last_error(), "device"), "good merge on a missing device: %d \"%s\"", rc,
          fd_last_error());
    t[2].desc.dtype = FD_FLOAT16;
    rc = fd_merge_tensors(t, sizeof t, 1, 2, FD_MERGE_OUTS_STACKED, NULL);
    CHECK(rc == FD_ERR_TYPE && strstr(fd_last_error(), "lses[1]: "), "lses[1] float16: %d \"%s\"", rc, fd_last_error());
    t[2].desc.dtype = FD_FLOAT32, t[4].desc.shape[1] = 4;
    rc = fd_merge_tensors(t, sizeof t, 1, 2, FD_MERGE_OUTS_STACKED, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "lse: "), "lse (2, 4): %d \"%s\"", rc, fd_last_error());
    rc = fd_merge_tensors(t, sizeof t - 8, 1, 2, FD_MERGE_OUTS_STACKED, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "tensors_size"), "short: %d \"%s\"", rc, fd_last_error());
    rc = fd_merge_tensors(NULL, 0, 1, 2, 0, NULL);
    CHECK(rc == FD_ERR_INVALID && strstr(fd_last_error(), "tensors"), "NULL: %d \"%s\"", rc, fd_last_error());
}

static void test_gpu(void) {
    CUdevice dev;
    CUcontext ctx = NULL;
    CUstream stream = NULL;
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    run_case("3 states, a pointer each, d64", 3, 2, 3, 4, 64, 1, 1, stream);
    run_case("20 states stacked, d256, no lse", 20, 1, 5, 7, 256, 0, 0, stream);
    run_case("2 states stacked, d4, legacy stream", 2, 3, 1, 2, 4, 0, 1, NULL);
done:
    if (stream) cuStreamDestroy(stream);
    if (ctx) cuDevicePrimaryCtxRelease(dev);
}

int main(void) {
    test_errors();
    test_tensors();
    int devices = 0;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&devices) != CUDA_SUCCESS) devices = 0;
    if (devices > 0) {
        printf("GPU tests on %d device(s)\n", devices);
        test_gpu();
    } else {
        printf("no CUDA device: GPU tests skipped\n");
        fd_merge_args a = valid_args();
        int rc = fd_merge_states(&a, NULL);
        CHECK(rc != FD_OK && fd_last_error()[0] != '\0', "merge on missing device 0: %d \"%s\"", rc, fd_last_error());
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
