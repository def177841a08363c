package cuda

import (
	"os"
	"runtime"
	"syscall"
	"testing"
	"unsafe"

	"github.com/flash-decode/flash-decode/core"
)

// BenchmarkPreparedRunFake is the host cost of a Prepared.Run of the plain b=1,
// 32/8-head, d128 call of 256 keys (one split) on the fake device, whose
// launches cost nothing: the checks, the plan lookup, the parameters and
// fd_run's driver calls.
func BenchmarkPreparedRunFake(b *testing.B) {
	if !fakeDevice() {
		b.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	if log, ok := os.LookupEnv("FAKECUDA_LAUNCH_LOG"); ok { // no file writes
		os.Unsetenv("FAKECUDA_LAUNCH_LOG")
		defer os.Setenv("FAKECUDA_LAUNCH_LOG", log)
	}
	const gib = uintptr(1) << 30
	s := core.Shape{DType: core.Float16, Batch: 1, SeqlenQ: 1, HeadsQ: 32, HeadsKV: 8, HeadDim: 128, SeqlenCache: 256, Seqlen: -1}
	p := core.Problem{Shape: s, Q: at(1*gib, 1, 32, 128), K: at(64*gib, 256, 8, 128), V: at(128*gib, 256, 8, 128), Out: at(2*gib, 1, 32, 128)}
	l := core.LayoutOf(&p)
	r, err := Prepare(&l, 0)
	if err != nil {
		b.Fatal(err)
	}
	args := Args{Q: 1 * gib, K: 64 * gib, V: 128 * gib, Out: 2 * gib}
	if _, err := r.Run(&args, -1, 0); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0 := threadTime()
	for b.Loop() {
		r.Run(&args, -1, 0)
	}
	b.ReportMetric(float64(threadTime()-t0)/float64(b.N), "cpu-ns/op")
}

// threadTime is the calling thread's CPU time in nanoseconds: on a shared
// machine, wall time also counts what other processes hold the CPU.
func threadTime() int64 {
	var ts syscall.Timespec
	const clockThreadCPUTime = 3 // CLOCK_THREAD_CPUTIME_ID
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0)
	return ts.Nano()
}
