package main

// The one-shot calls: fd_args (and fd_serving) are copied into a
// core.Layout, the call's addresses and its seqlen, and run the prepared
// API's path (cuda.DecodeLayout, cuda.PlanLayout) without holding a handle.

/*
#include "flashdecode.h"
*/
import "C"

import (
	"github.com/flash-decode/flash-decode/core"
	"github.com/flash-decode/flash-decode/core/cuda"
)

// argsNames are the fd_args and fd_serving fields of core's argument
// names: the caches are fd_args.k and v, the new tokens fd_serving.k_new
// and v_new.
var argsNames = map[string]string{
	"k_cache": "k", "v_cache": "v", "k": "k_new", "v": "v_new",
	"nheads_q": "heads_q", "nheads_kv": "heads_kv", "headdim": "head_dim",
	"softmax_scale": "scale", "window_size": "window", "max_seqlen_k": "seqlen",
}

// strides4 is a tensor's strides as a layout holds them.
func strides4(t *C.fd_tensor) [4]int64 {
	return [4]int64{int64(t.batch_stride), int64(t.seq_stride), int64(t.head_stride), 1}
}

// argsLayout returns the layout, addresses and seqlen of a call of a and,
// when not NULL, sv. C callers pass the same fd_args to the plan as to the
// decode, so whether cache_seqlens is given decides device_lengths for
// both; a feature of fd_serving without a flag (leftpad, ALiBi) is on
// when its array is given.
func argsLayout(a *C.fd_args, sv *C.fd_serving) (core.Layout, cuda.Args, int) {
	flag := func(on bool) int64 {
		if on {
			return 1
		}
		return 0
	}
	l := core.Layout{DType: int64(a.dtype), Batch: int64(a.batch), SeqlenQ: int64(a.seqlen_q), HeadsQ: int64(a.heads_q),
		HeadsKV: int64(a.heads_kv), HeadDim: int64(a.head_dim), SeqlenCache: int64(a.seqlen_cache),
		NumSplits: int64(a.num_splits), DeviceLengths: flag(a.cache_seqlens != 0), Causal: flag(a.causal != 0),
		Scale: float64(a.scale), Q: strides4(&a.q), KCache: strides4(&a.k), VCache: strides4(&a.v), Out: strides4(&a.out),
		WindowLeft: -1, WindowRight: -1}
	args := cuda.Args{Q: uintptr(a.q.ptr), K: uintptr(a.k.ptr), V: uintptr(a.v.ptr), Out: uintptr(a.out.ptr),
		LSE: uintptr(a.lse), CacheSeqlens: uintptr(a.cache_seqlens)}
	if sv != nil {
		l.PageSize, l.NumPages, l.MaxPages = int64(sv.page_size), int64(sv.num_pages), int64(sv.max_pages)
		l.BlockTable = [2]int64{int64(sv.block_table_stride), 1}
		l.CacheBatch, l.Leftpad = int64(sv.cache_batch), flag(sv.cache_leftpad != 0)
		if sv.window != 0 {
			l.WindowLeft, l.WindowRight = int64(sv.window_left), int64(sv.window_right)
		}
		l.Softcap, l.Alibi = float64(sv.softcap), flag(sv.alibi_slopes != 0)
		l.AlibiSlopes = [2]int64{int64(sv.alibi_batch_stride), 1}
		l.SeqlenNew, l.KNew, l.VNew = int64(sv.seqlen_new), strides4(&sv.k_new), strides4(&sv.v_new)
		l.RotaryDim, l.RotaryRows = int64(sv.rotary_dim), int64(sv.rotary_rows)
		l.RotaryCos = [2]int64{int64(sv.rotary_stride), 1}
		l.RotarySin = l.RotaryCos
		l.RotaryInterleaved = flag(sv.rotary_interleaved != 0)
		args.BlockTable, args.CacheBatchIdx, args.CacheLeftpad = uintptr(sv.block_table), uintptr(sv.cache_batch_idx), uintptr(sv.cache_leftpad)
		args.AlibiSlopes, args.KNew, args.VNew = uintptr(sv.alibi_slopes), uintptr(sv.k_new.ptr), uintptr(sv.v_new.ptr)
		args.RotaryCos, args.RotarySin = uintptr(sv.rotary_cos), uintptr(sv.rotary_sin)
	}
	return l, args, max(int(a.seqlen), -1) // fd_args: any negative seqlen is the whole cache
}

// argsError names err's argument as fd_args and fd_serving do.
func argsError(err error, a *C.fd_args) error {
	return renamed(err, argsNames, a.cache_seqlens != 0)
}

//export fdgo_decode
func fdgo_decode(a *C.fd_args, sv *C.fd_serving, workspace C.uintptr_t, workspaceBytes C.size_t, stream C.uintptr_t) (ret C.int) {
	defer guard(&ret)
	if a == nil {
		return finish(errNull("decode", "args"))
	}
	l, args, seqlen := argsLayout(a, sv)
	args.Workspace, args.WorkspaceBytes = uintptr(workspace), sizeArg(workspaceBytes)
	_, err := cuda.DecodeLayout(&l, int(a.device), &args, seqlen, uintptr(stream))
	return finish(argsError(err, a))
}

// argsPlan returns the plan of a call of a and sv (when not NULL): what
// fd_decode_serving would refuse whatever the tensors (the sizes and
// options, an append's start) is refused.
func argsPlan(op string, a *C.fd_args, sv *C.fd_serving) (core.Plan, error) {
	if a == nil {
		return core.Plan{}, errNull(op, "args")
	}
	l, _, seqlen := argsLayout(a, sv)
	pl, err := cuda.PlanLayout(&l, int(a.device), seqlen)
	return pl, argsError(err, a)
}

//export fdgo_args_workspace_size
func fdgo_args_workspace_size(a *C.fd_args, sv *C.fd_serving, bytes *C.size_t) (ret C.int) {
	defer guard(&ret)
	if bytes == nil {
		return finish(errNull("workspace_size", "bytes"))
	}
	pl, err := argsPlan("workspace_size", a, sv)
	if err == nil {
		*bytes = C.size_t(pl.WorkspaceBytes)
	}
	return finish(err)
}

//export fdgo_args_plan
func fdgo_args_plan(a *C.fd_args, sv *C.fd_serving, out *C.fd_plan_info) (ret C.int) {
	defer guard(&ret)
	if out == nil {
		return finish(errNull("plan", "plan"))
	}
	pl, err := argsPlan("plan", a, sv)
	if err != nil {
		return finish(err)
	}
	planInfo(&pl, out)
	return finish(nil)
}

//export fdgo_args_plan_json
func fdgo_args_plan_json(a *C.fd_args, sv *C.fd_serving, buf *C.char, bufSize C.size_t, needed *C.size_t) (ret C.int) {
	defer guard(&ret)
	pl, err := argsPlan("plan_json", a, sv)
	return writeJSON(pl, err, buf, bufSize, needed)
}
