package core

import (
	"errors"
	"fmt"
	"testing"
)

func TestErrorText(t *testing.T) {
	tests := []struct {
		err  *Error
		want string
	}{
		{&Error{Op: "decode", Arg: "nheads_q", Msg: "12 is not a multiple of nheads_kv=5", Err: ErrInvalid},
			"flashdecode: decode: nheads_q: invalid argument: 12 is not a multiple of nheads_kv=5"},
		{&Error{Op: "plan", Arg: "headdim", Msg: "100", Err: ErrUnsupported},
			"flashdecode: plan: headdim: not supported: 100"},
		{&Error{Op: "plan", Msg: "no arg", Err: ErrUnsupported}, "flashdecode: plan: not supported: no arg"},
		{&Error{Op: "decode", Arg: "q"}, "flashdecode: decode: q"},
		{&Error{}, "flashdecode"},
	}
	for _, tt := range tests {
		if got := tt.err.Error(); got != tt.want {
			t.Errorf("Error() = %q, want %q", got, tt.want)
		}
	}
}

func TestErrorUnwrap(t *testing.T) {
	err := fmt.Errorf("wrapped: %w", invalid("decode", "q", "x"))
	if !errors.Is(err, ErrInvalid) || errors.Is(err, ErrUnsupported) {
		t.Errorf("errors.Is wrong for %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Arg != "q" || e.Op != "decode" {
		t.Errorf("errors.As gave %+v", e)
	}
	if !errors.Is(unsupported("plan", "headdim", ""), ErrUnsupported) {
		t.Error("unsupported does not wrap ErrUnsupported")
	}
}
