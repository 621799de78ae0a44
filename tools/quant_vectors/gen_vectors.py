#!/usr/bin/env python3
"""Generate the quantization test vectors in shared/tests/data/quant/.

For every type the Rust CPU reference supports, this writes
  <TYPE>.bin  raw block bytes (whole blocks, back to back, as in a GGUF tensor)
  <TYPE>.f32  gguf-py's dequantization of them, little-endian f32
The blocks are random bytes, except that fp16 scale fields (d, m, dmin) are overwritten with
finite, moderate values (some negative) and MXFP4's e8m0 byte is never 0xFF (nor above 252, which would overflow), so no expected
value is NaN or Inf. The first blocks of every type are edge cases: all-zero quants, all-ones
quant bytes (max nibbles), negative scales, a zero scale, extreme MXFP4 exponents.

Deterministic (fixed seed): rerunning it must leave the files unchanged.
Reference: gguf==0.19.0 (gguf-py/gguf/quants.py), see README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parents[2] / "shared" / "tests" / "data" / "quant"
SEED = 0x5EED_0019

# type -> (byte offsets of fp16 scale fields, number of blocks to generate)
# offsets from ggml-common.h block structs.
FP16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.MXFP4: (),  # e8m0 byte at offset 0, handled separately
}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
ORDER = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)


def rand_fp16(rng: np.random.Generator, n: int, negative_ok: bool = True) -> np.ndarray:
    """Finite fp16 values of moderate magnitude (2^-12 .. 2^2), as uint16 bit patterns."""
    mag = np.exp2(rng.uniform(-12, 2, size=n)).astype(np.float32)
    sign = np.where(rng.random(n) < 0.25, -1, 1) if negative_ok else 1
    return (mag * sign).astype(np.float16).view(np.uint16)


def put_fp16(block: np.ndarray, off: int, bits: int) -> None:
    block[off:off + 2] = np.array([bits], dtype="<u2").view(np.uint8)


def gen_float(rng: np.random.Generator, ty: T, n: int = 256) -> np.ndarray:
    if ty == T.F32:
        vals = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-20, 20, n)).astype(np.float32)
        edges = np.array([0.0, -0.0, 1.0, -1.0, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                          np.finfo(np.float32).tiny, 1e-45, -1e-45], dtype=np.float32)
        vals[:len(edges)] = edges
        return vals.astype("<f4").view(np.uint8)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    if ty == T.F16:
        exp = (bits >> 10) & 0x1F
        bits = np.where(exp == 0x1F, bits & 0xBFFF, bits)  # no Inf/NaN
        edges = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00]
    else:  # BF16
        exp = (bits >> 7) & 0xFF
        bits = np.where(exp == 0xFF, bits & 0xBFFF, bits)
        edges = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
    bits = bits.astype(np.uint16)
    bits[:len(edges)] = edges
    return bits.astype("<u2").view(np.uint8)


def gen_blocks(rng: np.random.Generator, ty: T, n_blocks: int) -> np.ndarray:
    _, bb = GGML_QUANT_SIZES[ty]
    blocks = rng.integers(0, 256, (n_blocks, bb), dtype=np.uint16).astype(np.uint8)
    fields = FP16_FIELDS[ty]
    scale_bytes = np.zeros(bb, dtype=bool)
    for off in fields:
        scale_bytes[off:off + 2] = True
    if ty == T.MXFP4:
        scale_bytes[0] = True

    # Edge blocks: 0 = all-zero quant bytes, 1 = all-0xFF quant bytes (max nibbles / codes),
    # 2 = alternating 0x0F/0xF0 quant bytes; 3 = every scale negative; 4 = zero scales.
    blocks[0, ~scale_bytes] = 0x00
    blocks[1, ~scale_bytes] = 0xFF
    blocks[2, ~scale_bytes] = np.resize(np.array([0x0F, 0xF0], dtype=np.uint8), int((~scale_bytes).sum()))

    for i in range(n_blocks):
        for off in fields:
            put_fp16(blocks[i], off, int(rand_fp16(rng, 1)[0]))
        if i == 3:
            for off in fields:
                put_fp16(blocks[i], off, int(rand_fp16(rng, 1, negative_ok=False)[0]) | 0x8000)
        if i == 4 and fields:
            put_fp16(blocks[i], fields[0], 0x0000)
        if ty == T.MXFP4:
            # mostly moderate exponents (2^-20 .. 2^12 after halving), plus the extremes
            # (252 is the largest e whose 12 * 2^(e-128) is still finite in f32)
            e = {0: 0, 1: 1, 2: 2, 3: 127, 4: 128, 5: 252}.get(i, int(rng.integers(107, 141)))
            blocks[i, 0] = e
    return blocks


def main() -> int:
    rng = np.random.default_rng(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    total = 0
    for ty in ORDER:
        if ty in FLOAT_TYPES:
            data = gen_float(rng, ty)
            rows = data.reshape((4, -1))
        else:
            be, bb = GGML_QUANT_SIZES[ty]
            n_blocks = 16 if be == 32 else 12
            blocks = gen_blocks(rng, ty, n_blocks)
            rows = blocks.reshape((4, -1))  # 4 rows of several blocks each
        expected = gguf.quants.dequantize(rows, ty).astype(np.float32)
        if not np.all(np.isfinite(expected)):
            print(f"{ty.name}: non-finite expected values", file=sys.stderr)
            return 1
        raw = rows.tobytes()
        exp_bytes = expected.astype("<f4").tobytes()
        (OUT / f"{ty.name}.bin").write_bytes(raw)
        (OUT / f"{ty.name}.f32").write_bytes(exp_bytes)
        total += len(raw) + len(exp_bytes)
        print(f"{ty.name:7s} {len(raw):6d} bytes -> {expected.size:5d} f32")
    print(f"total {total} bytes in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
