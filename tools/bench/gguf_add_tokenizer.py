#!/usr/bin/env python3
"""Copies a GGUF file with the `tokenizer.*` metadata of another GGUF added (keys it lacks),
so that a synthetic model written by `minimax-rank write-synthetic` (no tokenizer) can be served
through the gateway by several ranks (`--synthetic` itself runs on one rank only).
Benchmark tooling; standard library only.
    gguf_add_tokenizer.py SRC.gguf TOKENIZER_FROM.gguf OUT.gguf
"""
import shutil
import struct
import sys

SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_string(f):
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n)


def skip_value(f, ty):
    """Returns the raw bytes of one value of type `ty` read from f."""
    if ty in SCALAR:
        return f.read(SCALAR[ty])
    if ty == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", n) + f.read(n)
    if ty == 9:
        ity, n = struct.unpack("<IQ", f.read(12))
        parts = [struct.pack("<IQ", ity, n)]
        for _ in range(n):
            parts.append(skip_value(f, ity))
        return b"".join(parts)
    raise ValueError(f"unknown GGUF value type {ty}")


def read_header(f):
    magic, version, n_t, n_kv = struct.unpack("<4sIQQ", f.read(24))
    if magic != b"GGUF":
        raise ValueError("not a GGUF file")
    kvs = []
    align = 32
    for _ in range(n_kv):
        key = read_string(f)
        (ty,) = struct.unpack("<I", f.read(4))
        raw = skip_value(f, ty)
        if key == b"general.alignment":
            align = struct.unpack("<I", raw)[0]
        kvs.append((key, ty, raw))
    infos = []
    for _ in range(n_t):
        name = read_string(f)
        (nd,) = struct.unpack("<I", f.read(4))
        rest = f.read(8 * nd + 4 + 8)
        infos.append(struct.pack("<Q", len(name)) + name + struct.pack("<I", nd) + rest)
    data_start = (f.tell() + align - 1) // align * align
    return version, kvs, infos, align, data_start


def main():
    src, tok, out = sys.argv[1:4]
    with open(tok, "rb") as f:
        _, tkvs, _, _, _ = read_header(f)
    with open(src, "rb") as f:
        version, kvs, infos, align, data_start = read_header(f)
        have = {k for k, _, _ in kvs}
        add = [kv for kv in tkvs if kv[0].startswith(b"tokenizer.") and kv[0] not in have]
        if not add:
            sys.exit(f"{tok} has no tokenizer.* keys that {src} lacks")
        allkv = kvs + add
        head = struct.pack("<4sIQQ", b"GGUF", version, len(infos), len(allkv))
        head += b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<I", ty) + raw for k, ty, raw in allkv)
        head += b"".join(infos)
        head += b"\0" * ((-len(head)) % align)
        f.seek(data_start)
        with open(out, "wb") as o:
            o.write(head)
            shutil.copyfileobj(f, o, 64 << 20)
    print(f"{out}: {len(add)} tokenizer keys from {tok} added to {src}")


if __name__ == "__main__":
    main()
