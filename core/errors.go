package core

import "errors"

// The sentinel errors every flash-decode error wraps. Callers test them with
// errors.Is; the Python layer maps ErrInvalid to ValueError,
// ErrUnsupported to NotImplementedError and ErrType to TypeError.
var (
	// ErrInvalid reports an argument that can never be right, such as a
	// negative batch or nheads_q that is not a multiple of nheads_kv.
	ErrInvalid = errors.New("invalid argument")
	// ErrUnsupported reports a well-formed argument this build has no kernel
	// for, such as headdim 100; the message names what is supported.
	ErrUnsupported = errors.New("not supported")
	// ErrType reports an argument of the wrong type, such as a float32 q
	// or an int64 cache_seqlens (Python's TypeError).
	ErrType = errors.New("wrong type")
)

// Error is the error every core function returns. It names the operation,
// the argument (as the Python user knows it: q, k_cache, nheads_q, headdim,
// num_splits, ...) and wraps ErrInvalid or ErrUnsupported, so
//
//	flashdecode: decode: nheads_q: invalid argument: 12 is not a multiple of nheads_kv=5
//
// both reads well and matches errors.Is(err, ErrInvalid).
type Error struct {
	Op  string // operation: "decode", "plan", ...
	Arg string // argument at fault, or "" when none applies
	Msg string // what is wrong with it, without the sentinel's text
	Err error  // ErrInvalid, ErrUnsupported or an underlying error
}

// Error returns "flashdecode: Op: Arg: Err: Msg", leaving out empty parts.
func (e *Error) Error() string {
	s := "flashdecode"
	if e.Op != "" {
		s += ": " + e.Op
	}
	if e.Arg != "" {
		s += ": " + e.Arg
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Unwrap returns the wrapped error, so errors.Is(err, ErrInvalid) works.
func (e *Error) Unwrap() error { return e.Err }

// invalid returns an *Error wrapping ErrInvalid.
func invalid(op, arg, msg string) error {
	return &Error{Op: op, Arg: arg, Msg: msg, Err: ErrInvalid}
}

// wrongType returns an *Error wrapping ErrType.
func wrongType(op, arg, msg string) error {
	return &Error{Op: op, Arg: arg, Msg: msg, Err: ErrType}
}

// unsupported returns an *Error wrapping ErrUnsupported.
func unsupported(op, arg, msg string) error {
	return &Error{Op: op, Arg: arg, Msg: msg, Err: ErrUnsupported}
}
