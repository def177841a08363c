"""Layout records by field name, as a C caller fills fd_layout, for tests that hand the
binding a layout of their own (the torch layer sends the core a call's tensors instead)."""

import ctypes
import struct

from flash_decode import _api, _native


def prepare(native, fields, device):
    """The handle of the layout fields (core.Layout's by name, arrays as tuples, 0 where not given) on
    device; the core's error raised as the torch layer raises it."""
    names = [f.split(":") for f in native.LayoutFields().split(",")]
    record = struct.Struct("=" + "".join(kind for _, kind in names))
    flat = {}
    for name, value in fields.items():
        flat.update({f"{name}[{i}]": x for i, x in enumerate(value)} if isinstance(value, tuple) else {name: value})
    values = [flat.pop(name, 0) for name, _ in names]
    assert not flat, f"no layout fields {sorted(flat)}"
    buffer = ctypes.create_string_buffer(record.pack(*values), record.size)
    if (handle := native.Prepare(ctypes.addressof(buffer), record.size, device)) < 0:
        raise _native.error(native, handle)
    return handle


def layout_of(**call):
    """The layout fields (arrays as tuples) the core makes of a flash_decode call's tensors and options."""
    native, record = _api._call(**call)
    names = [f.split(":") for f in native.LayoutFields().split(",")]
    fields = {}
    for (name, _), value in zip(names, struct.unpack("=" + "".join(k for _, k in names),
                                                     _api._layout(native, record).raw)):
        base, _, index = name.partition("[")
        fields[base] = fields.get(base, ()) + (value,) if index else value
    return fields
