package cuda

import (
	"errors"
	"strings"
	"testing"

	"github.com/flash-decode/flash-decode/core"
)

// checkAddresses refuses each address below minAddress by its argument's
// name, and takes 0 and minAddress itself.
func TestCheckAddressesNamesTheLowOne(t *testing.T) {
	var p core.Problem
	var ws uintptr
	fields := []struct {
		name string
		ptr  *uintptr
	}{
		{"q", &p.Q.Ptr}, {"k_cache", &p.K.Ptr}, {"v_cache", &p.V.Ptr}, {"out", &p.Out.Ptr}, {"lse", &p.LSE},
		{"cache_seqlens", &p.CacheSeqlens}, {"block_table", &p.BlockTable}, {"cache_batch_idx", &p.CacheBatchIdx},
		{"cache_leftpad", &p.CacheLeftpad}, {"alibi_slopes", &p.AlibiSlopes}, {"k", &p.New.K.Ptr}, {"v", &p.New.V.Ptr},
		{"rotary_cos", &p.Rotary.Cos}, {"rotary_sin", &p.Rotary.Sin}, {"k_descale", &p.KDescale.Ptr},
		{"v_descale", &p.VDescale.Ptr}, {"sinks", &p.Sinks}, {"cu_seqlens_q", &p.CuSeqlensQ}, {"workspace", &ws},
	}
	if err := checkAddresses(&p, ws); err != nil {
		t.Fatalf("all 0: %v", err)
	}
	for _, f := range fields {
		for _, bad := range []uintptr{1, minAddress - 1} {
			*f.ptr = bad
			var e *core.Error
			if err := checkAddresses(&p, ws); !errors.As(err, &e) || e.Arg != f.name || !errors.Is(err, core.ErrInvalid) ||
				!strings.Contains(err.Error(), "not a device address") {
				t.Errorf("%s at %#x: %v", f.name, bad, err)
			}
		}
		*f.ptr = minAddress
	}
	if err := checkAddresses(&p, ws); err != nil {
		t.Fatalf("all at minAddress: %v", err)
	}
}
