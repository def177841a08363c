package core

// Version is the flash-decode release, shared by the Go, C and Python APIs.
const Version = "0.1.0"
