package binding

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// Every exported function starts with defer recoverError(&err), err being
// its named error result: gopy wraps each one for Python, where a Go panic
// would end the process.
func TestExportedFunctionsRecover(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	n := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !fn.Name.IsExported() {
				continue
			}
			n++
			if !defersRecover(fn) {
				t.Errorf("%s: %s does not start with defer recoverError(&err)", fset.Position(fn.Pos()), fn.Name.Name)
			}
		}
	}
	if n < 5 { // Plan, Version, Prepare, Workspace, Run
		t.Errorf("found %d exported functions", n)
	}
}

func defersRecover(fn *ast.FuncDecl) bool {
	res := fn.Type.Results
	if res == nil || len(fn.Body.List) == 0 {
		return false
	}
	last := res.List[len(res.List)-1]
	if len(last.Names) != 1 || last.Names[0].Name != "err" {
		return false
	}
	d, ok := fn.Body.List[0].(*ast.DeferStmt)
	if !ok {
		return false
	}
	callee, ok := d.Call.Fun.(*ast.Ident)
	if !ok || callee.Name != "recoverError" || len(d.Call.Args) != 1 {
		return false
	}
	u, ok := d.Call.Args[0].(*ast.UnaryExpr)
	if !ok || u.Op != token.AND {
		return false
	}
	id, ok := u.X.(*ast.Ident)
	return ok && id.Name == "err"
}
