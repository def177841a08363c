"""A stand-in for the Go binding's layout door, for CPU tests of the torch layer:
the real binding checks each call's tensors record and makes its layout, which the
stand-in reads back; it records every call. test_native checks its field list
against the real binding's."""

import ctypes
import struct

import pytest

from conftest import FakeBinding

# core.Layout's fields in order ("name" an int64, "name:d" a float64, "name:n" n int64s).
LAYOUT = ("dtype batch seqlen_q heads_q heads_kv head_dim seqlen_cache num_splits device_lengths causal scale:d "
          "q:4 k_cache:4 v_cache:4 out:4 page_size num_pages max_pages block_table:2 cache_batch leftpad "
          "window_left window_right softcap:d alibi alibi_slopes:2 seqlen_new k_new:4 v_new:4 rotary_dim "
          "rotary_rows rotary_cos:2 rotary_sin:2 rotary_interleaved kv_dtype descale k_descale:2 v_descale:2 "
          "k_descale_value:d v_descale_value:d sinks batch_invariant ragged total_q").split()
FIELDS = [(f"{name}[{i}]" if n.isdigit() else name, "d" if n == "d" else "q")
          for name, _, n in (f.partition(":") for f in LAYOUT) for i in range(int(n) if n.isdigit() else 1)]


class LayoutBinding(FakeBinding):
    """FakeBinding for the layout door: PrepareTensors has the real binding check the
    call and make its layout, then Prepare records the layout it reads (an array field
    as a tuple) and the device; Run refuses a call whose workspace is short of
    Workspace's answer (need), as the core does, and records the calls it takes;
    handles start at 1."""

    def __init__(self, real):
        super().__init__()
        self.errors = []
        self.real = real

    def LayoutFields(self):
        return ",".join(f"{name}:{kind}" for name, kind in FIELDS)

    def TensorsFields(self):
        return self.real.TensorsFields()

    def TensorsLayout(self, *args):
        status = self.real.TensorsLayout(*args)
        return status if status >= 0 else self.fail(self.real.ErrorKind(status), self.real.ErrorMessage(status))

    def PrepareTensors(self, address, size):
        layout = ctypes.create_string_buffer(8 * len(FIELDS))
        if (status := self.TensorsLayout(address, size, ctypes.addressof(layout), ctypes.sizeof(layout))) < 0:
            return status
        names = [f.split(":")[0] for f in self.TensorsFields().split(",")]
        (device,) = struct.unpack_from("=q", ctypes.string_at(address, size), 8 * names.index("q.device"))
        if device < 0:
            return self.fail(1, "flashdecode: prepare: q: invalid argument: must be a CUDA tensor")
        return self.Prepare(ctypes.addressof(layout), ctypes.sizeof(layout), device)

    def Prepare(self, address, size, device):
        record = ctypes.string_at(address, size)
        layout = {}
        for (name, _), value in zip(FIELDS, struct.unpack("=" + "".join(k for _, k in FIELDS), record)):
            base, _, index = name.partition("[")
            layout[base] = layout.get(base, ()) + (value,) if index else value
        self.calls.append(("Prepare", (layout, device)))
        return self.handles.setdefault((record, device), len(self.handles) + 1)

    def need(self, seqlen):
        """The workspace bytes of a call with seqlen."""
        return 1000 if seqlen < 0 else 8 * seqlen

    def Workspace(self, handle, seqlen):
        self.calls.append(("Workspace", (handle, seqlen)))
        return self.need(seqlen)

    def Run(self, *args):
        if args[-2] < self.need(args[1]):
            return self.fail(1, f"flashdecode: decode: workspace: invalid argument: {args[-2]} bytes")
        return super().Run(*args)

    def Release(self, handle):
        return 0

    def fail(self, kind, message):
        self.errors.append((kind, message))
        return -len(self.errors)

    def ErrorKind(self, status):
        return self.errors[-status - 1][0]

    def ErrorMessage(self, status):
        return self.errors[-status - 1][1]


@pytest.fixture
def layout_binding(real_binding, fake_binding, monkeypatch):
    """conftest's fake_binding (CPU tensors taken as device 0's, an empty layout cache)
    over a LayoutBinding."""
    from flash_decode import _native
    fake = LayoutBinding(real_binding)
    monkeypatch.setattr(_native, "binding", lambda planner_only=False: fake)
    return fake
