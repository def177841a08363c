"""The ELF dynamic section of a built shared library: read it, and drop its run paths.

gopy -dynamic-link copies the interpreter's LDSHARED flags into the extension's link, and
those can hold -Wl,-rpath,<the build machine's Python lib folder>: the library would then
search that folder on every machine it is installed on. remove_runpath deletes DT_RPATH and
DT_RUNPATH entries in place, as `patchelf --remove-rpath` does, so the build needs no tool
beyond Python. 32- and 64-bit ELF, either byte order.
"""
import struct

PT_DYNAMIC = 2
DT_NULL, DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH = 0, 1, 14, 15, 29
RUN_PATH_TAGS = (DT_RPATH, DT_RUNPATH)


def _layout(data):
    """Return (byte order, program header format, dynamic entry format, e_phoff, e_phentsize,
    e_phnum) for the ELF image data."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    order = {1: "<", 2: ">"}.get(data[5])
    if order is None:
        raise ValueError(f"unknown ELF byte order {data[5]}")
    if data[4] == 2:  # ELFCLASS64
        (phoff,) = struct.unpack_from(order + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
        # p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
        return order, "IIQQQQQQ", "qQ", phoff, phentsize, phnum
    if data[4] == 1:  # ELFCLASS32
        (phoff,) = struct.unpack_from(order + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
        # p_type, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_flags, p_align
        return order, "IIIIIIII", "iI", phoff, phentsize, phnum
    raise ValueError(f"unknown ELF class {data[4]}")


def _dynamic(data):
    """Return (file offset of the dynamic section, entry format, [(tag, value)] up to and
    without the DT_NULL that ends it)."""
    order, ph, dyn, phoff, phentsize, phnum = _layout(data)
    for i in range(phnum):
        fields = struct.unpack_from(order + ph, data, phoff + i * phentsize)
        if fields[0] != PT_DYNAMIC:
            continue
        offset, filesz = (fields[2], fields[5]) if ph == "IIQQQQQQ" else (fields[1], fields[4])
        size = struct.calcsize(order + dyn)
        entries = []
        for pos in range(offset, offset + filesz - size + 1, size):
            tag, value = struct.unpack_from(order + dyn, data, pos)
            if tag == DT_NULL:
                break
            entries.append((tag, value))
        return offset, order + dyn, entries
    raise ValueError("no dynamic section (not a shared library?)")


def dynamic_tags(path):
    """Return the tags of the dynamic section's entries, in order."""
    with open(path, "rb") as f:
        return [tag for tag, _ in _dynamic(f.read())[2]]


def remove_runpath(path):
    """Delete the DT_RPATH and DT_RUNPATH entries of the ELF shared library at path, in
    place: later entries move up and DT_NULLs fill the end (the strings stay in .dynstr,
    unreferenced). Return how many entries were removed."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    offset, fmt, entries = _dynamic(data)
    kept = [e for e in entries if e[0] not in RUN_PATH_TAGS]
    removed = len(entries) - len(kept)
    if removed:
        size = struct.calcsize(fmt)
        for i, (tag, value) in enumerate(kept + [(DT_NULL, 0)] * removed):
            struct.pack_into(fmt, data, offset + i * size, tag, value)
        with open(path, "wb") as f:
            f.write(data)
    return removed
