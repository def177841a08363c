package core

import (
	"encoding/json"
	"fmt"
	"strings"
)

// String returns a one-line summary of p, for logs and error reports.
func (p Plan) String() string {
	var b strings.Builder
	if p.Append != "" {
		fmt.Fprintf(&b, "%s grid (%d,%d,%d) x %d threads, then ", p.Append, p.AppendGrid[0], p.AppendGrid[1], p.AppendGrid[2], p.AppendThreads)
	}
	fmt.Fprintf(&b, "%s grid (%d,%d,%d) x %d threads, %d B shared, %d/SM on %d SMs",
		p.Variant.Kernel, p.Grid[0], p.Grid[1], p.Grid[2], p.Threads, p.SharedBytes, p.BlocksPerSM, p.SMs)
	switch p.Merge {
	case MergeNone:
		b.WriteString("; 1 split, no combine")
		if p.InvariantTiles > 0 {
			fmt.Fprintf(&b, " (batch-invariant, %d tiles a split)", p.InvariantTiles)
		}
	case MergeCluster:
		fmt.Fprintf(&b, "; %d splits merged in clusters of %d, no combine", p.NumSplits, p.Cluster)
	case MergePairs:
		fmt.Fprintf(&b, "; %d splits merged in pairs (clusters of %d, two blocks an SM), no combine", p.NumSplits, p.Cluster)
	case MergeBalanced:
		fmt.Fprintf(&b, "; %d splits for equal lengths, balanced by the lengths on the device (at most %d a sequence); combine %s %d x %d threads",
			p.BalanceSplits, p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads)
	case MergeInvariant:
		fmt.Fprintf(&b, "; batch-invariant, %d tiles a split, at most %d splits a sequence; combine %s %d x %d threads",
			p.InvariantTiles, p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads)
	case MergeTail:
		fmt.Fprintf(&b, "; %d items whole, the rest in %d splits; combine %s %d x %d threads from row %d",
			p.WholeItems, p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads, p.CombineRow0)
	default:
		fmt.Fprintf(&b, "; %d splits; combine %s %d x %d threads", p.NumSplits, p.Combine, p.CombineGrid, p.CombineThreads)
	}
	switch {
	case p.WorkspaceBytes == 0:
		b.WriteString(", no workspace")
	case p.CombineGrid == 0:
		fmt.Fprintf(&b, "; workspace %d B (q_rot)", p.WorkspaceBytes)
	case p.QRotBytes > 0:
		fmt.Fprintf(&b, "; workspace %d B (lse_partial at %d, q_rot at %d)", p.WorkspaceBytes, p.LSEPartialOffset, p.QRotOffset)
	default:
		fmt.Fprintf(&b, "; workspace %d B (lse_partial at %d)", p.WorkspaceBytes, p.LSEPartialOffset)
	}
	return b.String()
}

// variantJSON is Variant with snake_case JSON names.
type variantJSON struct {
	Kernel                 string `json:"kernel"`
	Combine                string `json:"combine"`
	DType                  string `json:"dtype"`
	HeadDim                int    `json:"head_dim"`
	Rows                   int    `json:"rows"`
	Threads                int    `json:"threads"`
	KeysPerTile            int    `json:"keys_per_tile"`
	SharedBytes            int    `json:"shared_bytes"`
	ClusterShared          int    `json:"cluster_shared_bytes"`
	ClusterDenseShared     int    `json:"cluster_dense_shared_bytes"`
	CombineThreads         int    `json:"combine_threads"`
	CombineRows            int    `json:"combine_rows"`
	CombineWide            string `json:"combine_wide"`
	CombineWideThreads     int    `json:"combine_wide_threads"`
	CombineWideCols        int    `json:"combine_wide_cols"`
	CombineNarrow          string `json:"combine_narrow"`
	CombineNarrowRows      int    `json:"combine_narrow_rows"`
	CombineNarrowDense     string `json:"combine_narrow_dense"`
	CombineNarrowDenseRows int    `json:"combine_narrow_dense_rows"`
	Form                   string `json:"form"`
	Append                 string `json:"append,omitzero"`
	// The form's properties, as flags (Form's methods).
	Serving     bool `json:"serving,omitzero"`
	Paged       bool `json:"paged,omitzero"`
	FusedAppend bool `json:"fused_append,omitzero"`
}

// MarshalJSON encodes p with snake_case names throughout, the variant's
// dtype as its torch name ("float16"), for the Python and C callers.
func (p Plan) MarshalJSON() ([]byte, error) {
	type plain Plan // drops the methods: no recursion
	v := p.Variant
	return json.Marshal(struct {
		Variant variantJSON `json:"variant"`
		plain
		FusedAppend bool `json:"fused_append,omitzero"`
	}{variantJSON{v.Kernel, v.Combine, v.DType.String(), v.HeadDim, v.Rows, v.Threads,
		v.KeysPerTile, v.SharedBytes, v.ClusterSharedBytes, v.ClusterDenseSharedBytes, v.CombineThreads, v.CombineRows,
		v.CombineWide, v.CombineWideThreads, v.CombineWideCols, v.CombineNarrow, v.CombineNarrowRows,
		v.CombineNarrowDense, v.CombineNarrowDenseRows, v.Form.String(), v.Append, v.Form.Serving(), v.Form.Paged(),
		v.Form.FusedAppend()}, plain(p), p.FusedAppend()})
}
