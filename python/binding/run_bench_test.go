package binding

import (
	"os"
	"testing"
)

// BenchmarkRun is the host cost of the binding's Run of the plain b=1,
// 32/8-head, d128 call of 256 keys on the fake device (see core/cuda's
// BenchmarkPreparedRunFake, which also reports thread CPU time): the handle
// lookup and Prepared.Run.
func BenchmarkRun(b *testing.B) {
	if os.Getenv("FLASH_DECODE_FAKE_DEVICE") != "1" {
		b.Skip("needs the fake-device driver: FLASH_DECODE_FAKE_DEVICE=1")
	}
	os.Unsetenv("FAKECUDA_LAUNCH_LOG") // no file writes
	const gib = uintptr(1) << 30
	layout := pack(b, dense(256))
	h := prepareBytes(layout, 0)
	if h < 0 {
		b.Fatal(ErrorMessage(h))
	}
	if n := Run(h, -1, 1*gib, 64*gib, 128*gib, 2*gib, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); n < 0 {
		b.Fatal(ErrorMessage(n))
	}
	b.ReportAllocs()
	for b.Loop() {
		Run(h, -1, 1*gib, 64*gib, 128*gib, 2*gib, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	}
}
