package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

func TestKindOf(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want Kind
	}{
		{nil, KindOK},
		{&core.Error{Arg: "batch", Err: core.ErrInvalid}, KindInvalid},
		{fmt.Errorf("wrapped: %w", &core.Error{Arg: "headdim", Err: core.ErrUnsupported}), KindUnsupported},
		{fmt.Errorf("flashdecode: %w: panic", ErrInternal), KindInternal},
		{&core.Error{Op: "prepare", Err: ErrLimit}, KindLimit},
		{&core.Error{Arg: "q", Err: core.ErrType}, KindType},
		{errors.New("cuLaunchKernelEx: out of resources"), KindCUDA},
	} {
		if got := KindOf(tt.err); got != tt.want {
			t.Errorf("KindOf(%v) = %d, want %d", tt.err, got, tt.want)
		}
	}
}
