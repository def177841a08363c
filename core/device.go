package core

// MaxCluster is the largest cluster a plan uses: kernels/cluster_merge.cuh
// merges at most 16 blocks (fd_split_kv_config::kMaxCluster), the most sm_90
// runs in one cluster.
const MaxCluster = 16

// targetWarpsPerSM is the stage-1 warps an SM needs to keep HBM busy: one
// block of 4 warps, whose 3-stage pipeline keeps 64 KiB of K/V in flight.
// The heuristic fills SMs to it, and a cluster launch of a block that size
// asks for an SM alone (Variant.ClusterSharedBytes).
const targetWarpsPerSM = 4

// Occupancy returns how many blocks of the stage-1 kernel of v can be
// resident on one SM at once. On a GPU the driver answers it
// (cuOccupancyMaxActiveBlocksPerMultiprocessor); DefaultOccupancy estimates it
// without one.
type Occupancy func(v Variant) int

// ClusterOccupancy returns how many thread-block clusters of size blocks of
// v's stage-1 kernel, launched with v.ClusterSharedBytes each, the GPU runs
// at once (cuOccupancyMaxActiveClusters); 0 when it cannot run them.
type ClusterOccupancy func(v Variant, size int) int

// Device is what the planner knows about a GPU.
type Device struct {
	SMs int // streaming multiprocessors
	// Occupancy tells the resident stage-1 blocks of a variant per SM; nil
	// means DefaultOccupancy.
	Occupancy Occupancy
	// Clusters tells how many thread-block clusters of stage 1 run at once
	// (sm_90 and newer); nil where the GPU has none, and then the combine
	// kernel merges every split plan. With it, short splits whose clusters
	// (one per sequence, K/V head and row tile) all run at once merge
	// inside stage 1 instead, and so do 2 splits in a grid of more blocks
	// than SMs, in pairs (see Plan.Cluster).
	Clusters ClusterOccupancy
}

// H200 is an NVIDIA H200 (and H100 SXM) as the planner sees it without
// asking the GPU: 132 SMs, occupancy from DefaultOccupancy, clusters from
// DefaultClusters.
var H200 = Device{SMs: 132, Clusters: DefaultClusters}

// DefaultClusters is ClusterOccupancy on an H200 without asking the GPU:
// what cuOccupancyMaxActiveClusters answered there for clusters of 1 and 2
// blocks per SM (at v.ClusterSharedBytes, see DefaultOccupancy), by size.
// A cluster lies within one GPC, so 16 blocks at one per SM fit only 7
// times on 132 SMs. Other blocks per SM: 132 * blocks per SM / size.
func DefaultClusters(v Variant, size int) int {
	if size < 1 || size > MaxCluster {
		return 0
	}
	v.SharedBytes = v.ClusterSharedBytes
	switch bps := DefaultOccupancy(v); bps {
	case 1:
		return h200Clusters[0][size]
	case 2:
		return h200Clusters[1][size]
	default:
		return 132 * bps / size
	}
}

// h200Clusters[b-1][size]: clusters of size blocks at b blocks per SM that
// run at once on an H200 (measured; size 1 is every SM's blocks).
var h200Clusters = [2][MaxCluster + 1]int{
	{0, 132, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7},
	{0, 264, 132, 79, 62, 47, 39, 32, 30, 23, 21, 16, 16, 14, 14, 14, 14},
}

// Per-SM limits of sm_90 (H100/H200) used by DefaultOccupancy.
const (
	smWarps          = 64         // 2048 threads
	smBlocks         = 32         // resident blocks
	smSharedBytes    = 228 * 1024 // shared memory per SM (at most 227 KB of it per block)
	smSharedReserved = 1024       // shared memory the system reserves per block
)

// DefaultOccupancy estimates the resident blocks of v per SM from its threads
// (whole warps, 2048 threads per SM) and dynamic shared memory (228 KB per SM,
// of which 1 KB is reserved per block) under sm_90's limit of 32 blocks. It
// ignores registers and static shared memory, so it may overestimate; it
// returns 0 when a block does not fit at all.
func DefaultOccupancy(v Variant) int {
	n := smBlocks
	if v.Threads > 0 {
		n = min(n, smWarps/((v.Threads+31)/32))
	}
	return min(n, smSharedBytes/(max(v.SharedBytes, 0)+smSharedReserved))
}

// blocksPerSM is d's occupancy of v.
func (d Device) blocksPerSM(v Variant) int {
	if d.Occupancy == nil {
		return DefaultOccupancy(v)
	}
	return d.Occupancy(v)
}
