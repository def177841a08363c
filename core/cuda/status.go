package cuda

import (
	"errors"

	"github.com/flash-decode/flash-decode/core"
)

// Kind is what sort of error a door reports, numbered as capi's fd_status
// (the Python binding's ErrorKind returns it too, and Python picks its
// exception by it: Invalid is ValueError, Unsupported NotImplementedError,
// Type TypeError, the others RuntimeError).
type Kind int

// The kinds, fd_status's FD_OK, FD_ERR_INVALID, ...
const (
	KindOK          Kind = 0
	KindInvalid     Kind = 1 // an argument can never be right (core.ErrInvalid)
	KindUnsupported Kind = 2 // well-formed, but no kernel for it (core.ErrUnsupported)
	KindCUDA        Kind = 3 // the driver failed
	KindBuffer      Kind = 4 // a caller's buffer is too small
	KindInternal    Kind = 5 // a bug in flash-decode (ErrInternal)
	KindLimit       Kind = 6 // a limit of the library, such as the layouts held (ErrLimit)
	KindForked      Kind = 7 // called in a child forked from the process that loaded the library
	KindType        Kind = 8 // an argument of the wrong type (core.ErrType)
)

// ErrInternal is wrapped by the error a door makes of a panic.
var ErrInternal = errors.New("internal error (please report)")

// KindOf returns err's kind: the core's sentinels, ErrInternal and
// ErrLimit by errors.Is, anything else (a driver call's failure) KindCUDA.
func KindOf(err error) Kind {
	switch {
	case err == nil:
		return KindOK
	case errors.Is(err, core.ErrInvalid):
		return KindInvalid
	case errors.Is(err, core.ErrUnsupported):
		return KindUnsupported
	case errors.Is(err, core.ErrType):
		return KindType
	case errors.Is(err, ErrInternal):
		return KindInternal
	case errors.Is(err, ErrLimit):
		return KindLimit
	}
	return KindCUDA
}
