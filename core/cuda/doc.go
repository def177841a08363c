// Package cuda runs flash decoding on an NVIDIA GPU.
//
// It is the device half of the Go core: package core validates a Problem and
// plans it (pure Go); this package turns the plan into kernel launches on the
// caller's stream. Its native API is Prepare (a core.Layout, validated once),
// then Workspace, Plan and Run per call; the C library (capi) and the Python
// binding are thin doors onto it (Handles numbers the prepared layouts for
// them), and Decode is the one-shot Go call. gorgonia.org/cu opens the device and its primary context;
// a few lines of cgo (launch.go) load the module, look up the kernels and
// launch them with the attributes gorgonia.org/cu lacks. Per device it
// retains the primary context (the one PyTorch allocates in), loads the
// embedded fatbin of kernels/ once and caches kernel handles, occupancy and
// plans, so a call
// makes no device allocation, no module load and no host synchronization:
// one or two cuLaunchKernel calls.
//
// Importing this package initializes the CUDA driver (gorgonia.org/cu's init
// calls cuInit and exits the process if that fails), so load it only where a
// driver is present; a stand-in libcuda.so.1
// (python/build_backend/make_libcuda.py) serves for tests on machines
// without one.
//
// The fatbin is built by `go generate ./core/cuda` (nvcc, see gen.go).
package cuda
