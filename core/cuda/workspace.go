package cuda

// Workspace returns the bytes of workspace Run needs when called with
// Args.Seqlen = seqlen: PlanFor's WorkspaceBytes for the prepared shape
// with that Seqlen (the planner sizes the splits by it; negative means the
// whole cache). Like PlanFor, it opens the device on first use.
func (r *Prepared) Workspace(seqlen int) (int, error) {
	p := r.Problem()
	p.Seqlen = seqlen
	if seqlen > p.SeqlenCache {
		return 0, p.ValidateLayout() // names cache_seqlens, as Run does
	}
	pl, err := PlanFor(p.PlanShape(), r.Device())
	if err != nil {
		return 0, err
	}
	return pl.WorkspaceBytes, nil
}
