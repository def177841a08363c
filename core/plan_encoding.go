package core

import (
	"encoding/json"
	"fmt"
	"strings"
)

// String returns a one-line summary of p, for logs and error reports.
func (p Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s grid (%d,%d,%d) x %d threads, %d B shared, %d/SM on %d SMs",
		p.Variant.Kernel, p.Grid[0], p.Grid[1], p.Grid[2], p.Threads, p.SharedBytes, p.BlocksPerSM, p.SMs)
	if p.NumSplits <= 1 {
		b.WriteString("; 1 split, no combine, no workspace")
		return b.String()
	}
	if p.Cluster > 1 {
		fmt.Fprintf(&b, "; %d splits merged in clusters of %d, no combine, no workspace", p.NumSplits, p.Cluster)
		return b.String()
	}
	if p.WholeItems > 0 {
		fmt.Fprintf(&b, "; %d items whole, the rest in %d splits; combine %s %d x %d threads from row %d; workspace %d B (lse_partial at %d)",
			p.WholeItems, p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads, p.CombineRow0, p.WorkspaceBytes, p.LSEPartialOffset)
		return b.String()
	}
	fmt.Fprintf(&b, "; %d splits; combine %s %d x %d threads; workspace %d B (lse_partial at %d)",
		p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads, p.WorkspaceBytes, p.LSEPartialOffset)
	return b.String()
}

// variantJSON is Variant with snake_case JSON names.
type variantJSON struct {
	Kernel             string `json:"kernel"`
	Combine            string `json:"combine"`
	DType              string `json:"dtype"`
	HeadDim            int    `json:"head_dim"`
	Rows               int    `json:"rows"`
	Threads            int    `json:"threads"`
	KeysPerTile        int    `json:"keys_per_tile"`
	SharedBytes        int    `json:"shared_bytes"`
	ClusterShared      int    `json:"cluster_shared_bytes"`
	ClusterDenseShared int    `json:"cluster_dense_shared_bytes"`
	CombineThreads     int    `json:"combine_threads"`
	CombineRows        int    `json:"combine_rows"`
	CombineWide        string `json:"combine_wide"`
	CombineWideThreads int    `json:"combine_wide_threads"`
}

// MarshalJSON encodes p with snake_case names throughout, the variant's
// dtype as its torch name ("float16"), for the Python and C callers.
func (p Plan) MarshalJSON() ([]byte, error) {
	type plain Plan // drops the methods: no recursion
	v := p.Variant
	return json.Marshal(struct {
		Variant variantJSON `json:"variant"`
		plain
	}{variantJSON{v.Kernel, v.Combine, v.DType.String(), v.HeadDim, v.Rows, v.Threads,
		v.KeysPerTile, v.SharedBytes, v.ClusterSharedBytes, v.ClusterDenseSharedBytes, v.CombineThreads, v.CombineRows,
		v.CombineWide, v.CombineWideThreads}, plain(p)})
}
