//! The weight uploader (`cuda::upload`) delivers every byte: whole tensors, row slices, block-
//! aligned column slices and unaligned (f32) column slices of every fixture (one file and a
//! split set), through tiny staging buffers (many batches, tensors split across them, strided
//! rows split between threads), with `pread` and with the memory mapping. Each device buffer
//! (also with rows padded by zeros to a byte multiple) is read back and compared byte for byte with the slice computed on the host; buffers are
//! poisoned before they are freed, so a later run's missing copy cannot pass on stale bytes.
//! Needs a GPU: run with `--ignored`.
#![cfg(feature = "cuda")]

mod common;

use std::ops::Range;

use minimax_rank::cuda::upload::{Io, UploadOptions, Uploader};
use minimax_rank::cuda::{DevMat, Gpu};
use minimax_shared::gguf::GgufModel;
use minimax_shared::quant::{self, GgmlType};

/// What one planned upload should put on the device.
struct Want {
    what: String,
    ptr: u64,
    bytes: Vec<u8>,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The host's version of `Uploader::mat_slice`.
fn host_slice(m: &GgufModel, name: &str, r: Range<usize>, c: Range<usize>) -> Vec<u8> {
    let t = m.tensor(name).unwrap();
    let (ncols, nrows) = (t.info.row_len(), t.info.dims[1] as usize);
    let ne = t.info.dims.get(2).copied().unwrap_or(1) as usize;
    let rb = quant::row_bytes(t.info.ty, ncols).unwrap();
    let (be, bb) = (t.info.ty.block_elems(), t.info.ty.block_bytes());
    let aligned = c.start % be == 0 && c.len() % be == 0;
    let mut out = Vec::new();
    for e in 0..ne {
        for row in r.clone() {
            let src = &t.data[(e * nrows + row) * rb..(e * nrows + row + 1) * rb];
            if aligned {
                out.extend_from_slice(&src[c.start / be * bb..c.end / be * bb]);
            } else {
                let v = quant::dequantize_to_vec(t.info.ty, src, ncols).unwrap();
                out.extend(f32_bytes(&v[c.clone()]));
            }
        }
    }
    out
}

fn check(gpu: &Gpu, path: &str, opts: UploadOptions) -> usize {
    let m = GgufModel::open(common::fixtures_dir().join(path)).unwrap();
    let mut up = Uploader::new(gpu, &m).with_options(opts);
    let mut want = Vec::new();
    fn add(want: &mut Vec<Want>, what: String, d: DevMat, bytes: Vec<u8>) {
        assert_eq!(d.n_bytes(), bytes.len(), "{what}: DevMat size");
        want.push(Want { what, ptr: d.ptr, bytes });
    }
    let names: Vec<_> = m.tensors().map(|t| (t.name.clone(), t.dims.clone(), t.ty)).collect();
    for (name, dims, ty) in &names {
        if dims.len() == 1 {
            let t = m.tensor(name).unwrap();
            let v = quant::dequantize_to_vec(t.info.ty, t.data, t.info.n_elems() as usize).unwrap();
            let p = up.vec_f32(name).unwrap();
            want.push(Want { what: format!("{name} f32"), ptr: p, bytes: f32_bytes(&v) });
            let n = v.len();
            let (p, h) = up.vec_f32_range(name, n / 3..n - 1).unwrap();
            assert_eq!(h, v[n / 3..n - 1]);
            want.push(Want { what: format!("{name} f32 range"), ptr: p, bytes: f32_bytes(&h) });
            continue;
        }
        let (ncols, nrows) = (dims[0] as usize, dims[1] as usize);
        let d = up.mat(name).unwrap();
        add(&mut want, format!("{name} whole"), d, m.tensor(name).unwrap().data.to_vec());
        let r = 1..nrows - 1;
        let d = up.mat_slice(name, Some(r.clone()), None).unwrap();
        add(&mut want, format!("{name} rows {r:?}"), d, host_slice(&m, name, r, 0..ncols));
        let be = ty.block_elems();
        if ncols >= 3 * be {
            let c = be..ncols - be;
            let d = up.mat_slice(name, Some(2..nrows), Some(c.clone())).unwrap();
            assert_eq!(d.ty, *ty);
            add(&mut want, format!("{name} aligned cols {c:?}"), d, host_slice(&m, name, 2..nrows, c.clone()));
            // The same slice stored with rows padded by zeros to a multiple of 48 bytes (the
            // layout tensor-parallel expert down slices get for the fast kernels).
            let d = up.mat_slice_padded(name, Some(2..nrows), Some(c.clone()), |_| 48).unwrap();
            let w = quant::row_bytes(*ty, c.len()).unwrap();
            let padded = w.div_ceil(48) * 48;
            assert_eq!((d.row_bytes, d.cols), (padded, c.len()), "{name}: padded slice shape");
            let rows = host_slice(&m, name, 2..nrows, c.clone());
            let bytes: Vec<u8> = rows.chunks(w).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0, padded - w))).collect();
            add(&mut want, format!("{name} aligned cols {c:?} padded to 48"), d, bytes);
        }
        let c = 1..ncols - 1;
        let d = up.mat_slice(name, None, Some(c.clone())).unwrap();
        // Columns that cut through quant blocks arrive as F32; types with one element per
        // block (F32/F16/BF16) are aligned at any column and keep their type.
        let want_ty = if be == 1 { *ty } else { GgmlType::F32 };
        assert_eq!(d.ty, want_ty, "{name}: column slice {c:?}");
        add(&mut want, format!("{name} f32 cols {c:?}"), d, host_slice(&m, name, 0..nrows, c));
    }
    let planned = up.planned_bytes();
    assert_eq!(planned, want.iter().map(|w| w.bytes.len()).sum::<usize>());
    let (bufs, stats) = up.finish().unwrap();
    assert_eq!(stats.bytes, planned);
    gpu.ctx.bind_to_thread().unwrap();
    for w in &want {
        let mut got = vec![0u8; w.bytes.len()];
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut got, w.ptr) }.unwrap();
        if got != w.bytes {
            let at = got.iter().zip(&w.bytes).position(|(a, b)| a != b).unwrap();
            panic!("{path} {opts:?}: {}: first wrong byte at {at} of {}", w.what, w.bytes.len());
        }
    }
    // Poison before freeing: the pool hands the same memory to the next run.
    for b in &bufs {
        unsafe { cudarc::driver::result::memset_d8_sync(gpu.ptr(b), 0xA5, b.len()) }.unwrap();
    }
    planned
}

#[test]
#[ignore = "needs a GPU"]
fn every_byte_of_every_slice_arrives() {
    let gpu = Gpu::new(0).unwrap();
    for path in ["m2-small/q8_0.gguf", "m2-small/kmix.gguf", "m2-small/split", "m2-odd/kmix.gguf", "m2-odd/f32.gguf"] {
        for io in [Io::Pread, Io::Mmap] {
            for (threads, chunk_bytes) in [(1, 64 << 20), (5, 300_007), (16, 4_099)] {
                let opts = UploadOptions { io, threads, chunk_bytes };
                let n = check(&gpu, path, opts);
                println!("{path}: {n} bytes ok ({opts:?})");
            }
        }
    }
}
