module github.com/flash-decode/flash-decode

go 1.26

require gorgonia.org/cu v0.9.6

require (
	github.com/go-python/gopy v0.5.0 // indirect
	github.com/gonuts/commander v0.1.0 // indirect
	github.com/gonuts/flag v0.1.0 // indirect
	github.com/google/uuid v1.1.1 // indirect
	github.com/pkg/errors v0.9.1 // indirect
	golang.org/x/mod v0.22.0 // indirect
	golang.org/x/sync v0.10.0 // indirect
	golang.org/x/tools v0.29.0 // indirect
)

tool (
	github.com/go-python/gopy
	golang.org/x/tools/cmd/goimports
)
