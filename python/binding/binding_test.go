package binding

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// Every exported function starts with defer recoverError(&r) (or
// recoverText(&r) for a string result), r being its one named result: gopy
// wraps each one for Python, where a Go panic would end the process.
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
				t.Errorf("%s: %s does not start with defer recoverError(&r) or recoverText(&r) of its named result", fset.Position(fn.Pos()), fn.Name.Name)
			}
		}
	}
	if n < 10 { // LayoutFields, Prepare, Workspace, Run, PlanJSON, Release, ErrorKind, ErrorMessage, MergeStates, Version
		t.Errorf("found %d exported functions", n)
	}
}

func defersRecover(fn *ast.FuncDecl) bool {
	res := fn.Type.Results
	if res == nil || len(res.List) != 1 || len(res.List[0].Names) != 1 || len(fn.Body.List) == 0 {
		return false
	}
	result := res.List[0].Names[0].Name
	want := "recoverError"
	if id, ok := res.List[0].Type.(*ast.Ident); ok && id.Name == "string" {
		want = "recoverText"
	}
	d, ok := fn.Body.List[0].(*ast.DeferStmt)
	if !ok {
		return false
	}
	callee, ok := d.Call.Fun.(*ast.Ident)
	if !ok || callee.Name != want || len(d.Call.Args) != 1 {
		return false
	}
	u, ok := d.Call.Args[0].(*ast.UnaryExpr)
	if !ok || u.Op != token.AND {
		return false
	}
	id, ok := u.X.(*ast.Ident)
	return ok && id.Name == result
}
