// launch.c: what one kernel launch costs the host, and one kernel of a replayed
// CUDA graph the GPU, for each way flash_decode may launch (a developer tool,
// not part of the library).
//
// The library launches stage 1 with cuLaunchKernelEx: with programmatic
// dependent launch (PDL) on sm_90 and newer, and in thread-block clusters when
// a sequence's splits merge inside the kernel. An eager call's host time is
// torch's, the binding's and the driver's; this program times the driver's
// part alone. Its kernel takes fd_params by value and waits on the kernel
// before it (griddepcontrol.wait), as the library's kernels do, and does
// nothing else, so what is timed is the launch:
//
//   host    µs a launch on the host: a round of back-to-back launches timed
//           with the host's clock, the stream synchronized after the clock
//           stops (a round never fills the launch queue); median and fastest
//           round, on the legacy default stream (torch's unless it is told
//           otherwise) and on a stream of its own
//   graph   µs a kernel on the GPU: a round's launches captured in a CUDA
//           graph and replayed between events, median replay; the floor of a
//           small case in BENCHMARKS.md's graph-timed table
//
// Forms: cuLaunchKernelEx with no attribute, with PDL, with clusters, with
// both, and with both for a kernel of an 8-byte parameter; cuLaunchKernel.
// The grids and shared memory are those of the plans of BENCHMARKS.md's
// eager call (b=1, 32/8 heads, d128, 256 keys: 4 splits in clusters of 4)
// and of b=1 at 1024 keys (8 splits in clusters of 8).
//
//   gcc -O2 -std=c11 -I/usr/local/cuda/include -Ikernels -o launch dev/launch/launch.c
//       -L/usr/local/cuda/lib64/stubs -lcuda    (one line)
//   ./launch [launches a round, 200] [rounds, 50]
//   ./launch ptx     prints the kernel's PTX (for ptxas, without a GPU)

#define _POSIX_C_SOURCE 200809L
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../core/cuda/launch.h"
#include "params.h"

// The kernel, as PTX for the driver to compile: its one parameter has
// fd_params' size and alignment; fd_launch_probe8's is 8 bytes, to show what
// the parameter's size costs.
static const char *kPTX =
    ".version 7.8\n"
    ".target sm_90\n"
    ".address_size 64\n"
    ".visible .entry fd_launch_probe(.param .align 8 .b8 p[%zu])\n"
    "{\n"
    "    griddepcontrol.wait;\n"
    "    ret;\n"
    "}\n"
    ".visible .entry fd_launch_probe8(.param .u64 p)\n"
    "{\n"
    "    griddepcontrol.wait;\n"
    "    ret;\n"
    "}\n";

enum { kThreads = 128, kSmem = 122880 };  // stage 1's at head dim 128, 16 rows

// One way to launch: the driver entry point, the attributes, the grid, the kernel.
typedef struct {
    const char *name;
    int ex;            // cuLaunchKernelEx, else cuLaunchKernel
    int pdl;           // programmatic stream serialization
    unsigned cluster;  // blocks a cluster along x; 1: none
    unsigned gx, gy;
    int small;         // fd_launch_probe8 (an 8-byte parameter), else fd_launch_probe
} form;

static const form kForms[] = {
    {"cuLaunchKernel, 4x8", 0, 0, 1, 4, 8, 0},
    {"Ex, 4x8", 1, 0, 1, 4, 8, 0},
    {"Ex, PDL, 4x8", 1, 1, 1, 4, 8, 0},
    {"Ex, clusters of 4, 4x8", 1, 0, 4, 4, 8, 0},
    {"Ex, PDL, clusters of 4, 4x8 (eager call's)", 1, 1, 4, 4, 8, 0},
    {"Ex, PDL, clusters of 4, 4x8, 8-byte parameter", 1, 1, 4, 4, 8, 1},
    {"Ex, PDL, 8x8", 1, 1, 1, 8, 8, 0},
    {"Ex, PDL, clusters of 8, 8x8 (b=1 1K's)", 1, 1, 8, 8, 8, 0},
};

static void die(const char *what, CUresult r) {
    const char *s = NULL;
    cuGetErrorName(r, &s);
    fprintf(stderr, "launch: %s: %s\n", what, s ? s : "unknown CUDA error");
    exit(1);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The Ex forms go through the library's own launch (core/cuda/launch.h), so
// what is timed is exactly what a call does.
static CUresult launch(CUfunction f, const form *fm, CUstream s, fd_params *p) {
    if (fm->ex) return fd_launch_kernel(f, fm->gx, fm->gy, 1, kThreads, kSmem, s, fm->pdl, fm->cluster, p);
    void *args[1] = {p};
    return cuLaunchKernel(f, fm->gx, fm->gy, 1, kThreads, 1, 1, kSmem, s, args, NULL);
}

// µs a launch on stream s: median and fastest of `rounds` rounds of `calls`
// launches; CUDA_SUCCESS or the first failure.
static CUresult host_us(CUfunction f, const form *fm, CUstream s, int calls, int rounds, double *med, double *best) {
    fd_params p;
    memset(&p, 0, sizeof p);
    double *t = calloc(rounds, sizeof *t);
    CUresult r = launch(f, fm, s, &p);  // warm-up
    if (r == CUDA_SUCCESS) r = cuStreamSynchronize(s);
    for (int i = 0; i < rounds && r == CUDA_SUCCESS; i++) {
        double t0 = now_us();
        for (int c = 0; c < calls && r == CUDA_SUCCESS; c++) r = launch(f, fm, s, &p);
        t[i] = (now_us() - t0) / calls;
        if (r == CUDA_SUCCESS) r = cuStreamSynchronize(s);
    }
    if (r == CUDA_SUCCESS) {
        *med = median(t, rounds);
        *best = t[0];  // sorted by median()
    }
    free(t);
    return r;
}

// µs a kernel on the GPU: `calls` launches captured on s (not the legacy
// stream: it cannot be captured) and replayed `rounds` times between events.
static CUresult graph_us(CUfunction f, const form *fm, CUstream s, int calls, int rounds, double *med) {
    fd_params p;
    memset(&p, 0, sizeof p);
    CUgraph g = NULL;
    CUgraphExec ge = NULL;
    CUevent *ev = calloc(rounds + 1, sizeof *ev);
    double *t = calloc(rounds, sizeof *t);
    int made = 0;
    CUresult r = cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL);
    for (int c = 0; c < calls && r == CUDA_SUCCESS; c++) r = launch(f, fm, s, &p);
    if (r == CUDA_SUCCESS) {
        r = cuStreamEndCapture(s, &g);
    } else {
        CUgraph dropped = NULL;
        cuStreamEndCapture(s, &dropped);  // leaves the stream usable
        if (dropped) cuGraphDestroy(dropped);
    }
    if (r == CUDA_SUCCESS) r = cuGraphInstantiate(&ge, g, 0);
    for (; made <= rounds && r == CUDA_SUCCESS; made++) r = cuEventCreate(&ev[made], CU_EVENT_DEFAULT);
    if (r == CUDA_SUCCESS) r = cuGraphLaunch(ge, s);  // warm-up
    if (r == CUDA_SUCCESS) r = cuEventRecord(ev[0], s);
    for (int i = 0; i < rounds && r == CUDA_SUCCESS; i++) {
        r = cuGraphLaunch(ge, s);
        if (r == CUDA_SUCCESS) r = cuEventRecord(ev[i + 1], s);
    }
    if (r == CUDA_SUCCESS) r = cuStreamSynchronize(s);
    for (int i = 0; i < rounds && r == CUDA_SUCCESS; i++) {
        float ms = 0;
        r = cuEventElapsedTime(&ms, ev[i], ev[i + 1]);
        t[i] = ms * 1e3 / calls;
    }
    if (r == CUDA_SUCCESS) *med = median(t, rounds);
    for (int i = 0; i < made; i++) cuEventDestroy(ev[i]);
    if (ge) cuGraphExecDestroy(ge);
    if (g) cuGraphDestroy(g);
    free(ev);
    free(t);
    return r;
}

static const char *err_name(CUresult r) {
    const char *s = NULL;
    cuGetErrorName(r, &s);
    return s ? s : "unknown CUDA error";
}

int main(int argc, char **argv) {
    char ptx[1024];
    snprintf(ptx, sizeof ptx, kPTX, sizeof(fd_params));
    if (argc > 1 && strcmp(argv[1], "ptx") == 0) {
        fputs(ptx, stdout);
        return 0;
    }
    int calls = argc > 1 ? atoi(argv[1]) : 200, rounds = argc > 2 ? atoi(argv[2]) : 50;
    if (calls < 1 || rounds < 1) {
        fprintf(stderr, "usage: launch [launches a round >= 1] [rounds >= 1]\n");
        return 2;
    }
    CUresult r;
    CUdevice dev;
    CUcontext ctx;
    if ((r = cuInit(0)) != CUDA_SUCCESS) die("cuInit", r);
    if ((r = cuDeviceGet(&dev, 0)) != CUDA_SUCCESS) die("cuDeviceGet", r);
    if ((r = cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) die("cuDevicePrimaryCtxRetain", r);
    if ((r = cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) die("cuCtxSetCurrent", r);

    CUmodule mod;
    CUfunction fs[2];  // by form.small
    if ((r = cuModuleLoadData(&mod, ptx)) != CUDA_SUCCESS) die("cuModuleLoadData", r);
    for (int i = 0; i < 2; i++) {
        if ((r = cuModuleGetFunction(&fs[i], mod, i ? "fd_launch_probe8" : "fd_launch_probe")) != CUDA_SUCCESS)
            die("cuModuleGetFunction", r);
        if ((r = cuFuncSetAttribute(fs[i], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kSmem)) != CUDA_SUCCESS)
            die("cuFuncSetAttribute", r);
    }
    CUstream own = NULL;
    CUresult own_err = cuStreamCreate(&own, CU_STREAM_NON_BLOCKING);  // its columns say n/a if it failed

    printf("%d launches a round, %d rounds; fd_params is %zu bytes; %d threads, %d bytes of shared memory a block\n\n",
           calls, rounds, sizeof(fd_params), kThreads, kSmem);
    printf("| form | host µs, legacy stream (median / fastest) | host µs, own stream | graph µs a kernel |\n");
    printf("| --- | --: | --: | --: |\n");
    for (size_t i = 0; i < sizeof kForms / sizeof kForms[0]; i++) {
        const form *fm = &kForms[i];
        CUfunction f = fs[fm->small];
        char cell[3][64];
        double med = 0, best = 0;
        CUstream streams[2] = {NULL, own};
        for (int k = 0; k < 2; k++) {
            r = k == 1 && own_err != CUDA_SUCCESS ? own_err : host_us(f, fm, streams[k], calls, rounds, &med, &best);
            if (r == CUDA_SUCCESS) snprintf(cell[k], sizeof cell[k], "%.2f / %.2f", med, best);
            else snprintf(cell[k], sizeof cell[k], "n/a (%s)", err_name(r));
        }
        r = own_err != CUDA_SUCCESS ? own_err : graph_us(f, fm, own, calls, rounds, &med);
        if (r == CUDA_SUCCESS) snprintf(cell[2], sizeof cell[2], "%.2f", med);
        else snprintf(cell[2], sizeof cell[2], "n/a (%s)", err_name(r));
        printf("| %s | %s | %s | %s |\n", fm->name, cell[0], cell[1], cell[2]);
    }
    if (own_err == CUDA_SUCCESS) cuStreamDestroy(own);
    cuModuleUnload(mod);
    cuDevicePrimaryCtxRelease(dev);
    return 0;
}
