//! Weight upload at disk speed: tensors (or tensor-parallel row/column slices of them) go from
//! the memory-mapped GGUF, any shard layout, to device memory in their quantized form.
//!
//! Loading is planned first and executed once: every `mat*`/`vec*` call allocates the device
//! buffer and records where its bytes come from ([`Piece`]s: a byte range of a shard, rows of
//! a strided slice, or bytes converted on the host). [`Uploader::finish`] sorts the pieces by
//! file position and streams them through a few pinned staging buffers: worker threads fill
//! one buffer in parallel (`pread` of large ranges, or `memcpy` from the mapping for small
//! rows; the page-cache misses of cold files are the bottleneck, so many reads are in
//! flight and the next buffers' ranges are announced with `madvise(WILLNEED)`), then
//! asynchronous host-to-device copies on a copy stream drain it while the next buffer fills.
//! Progress (bytes, GB/s, ETA) is logged every two seconds.
//!
//! Knobs (environment): `MINIMAX_LOAD_IO=pread|mmap` (default pread), `MINIMAX_LOAD_THREADS`
//! (default: available cores, at most 16), `MINIMAX_LOAD_CHUNK_MB` (staging buffer size,
//! default 128; four buffers).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use minimax_shared::gguf::GgufModel;
use minimax_shared::quant::{self, GgmlType};

use super::error::CudaError;
use super::gpu::{DevMat, Gpu};
use super::model::LoadStats;

/// Staging buffers in the ring (one filling, the others draining to the device).
const N_STAGING: usize = 4;
/// Pieces at least this long are read with `pread`; shorter rows are copied from the mapping.
const PREAD_MIN: usize = 256 << 10;
/// Seconds between progress lines.
const LOG_EVERY: Duration = Duration::from_secs(2);

/// Where a piece's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Src {
    /// Bytes converted on the host (f32 norms, unaligned column slices), index into `owned`.
    Owned(usize),
    /// A shard of the model file.
    Shard(usize),
}

/// `count` rows of `len` bytes, row `i` at `off + i * stride` of its source, written back to
/// back at device address `dst`, each followed by `pad` zero bytes (a padded row stride for
/// the fast kernels). A contiguous range is one row.
#[derive(Clone, Copy, Debug)]
struct Piece {
    src: Src,
    off: usize,
    len: usize,
    count: usize,
    stride: usize,
    pad: usize,
    dst: u64,
}

impl Piece {
    /// Bytes of one row as staged and stored (source bytes plus zero pad).
    fn row(&self) -> usize {
        self.len + self.pad
    }

    fn bytes(&self) -> usize {
        self.row() * self.count
    }

    /// Whether the piece is one contiguous range (split at any byte), not rows.
    fn contiguous(&self) -> bool {
        self.count == 1 && self.pad == 0
    }
}

/// Part of a piece placed in a staging buffer at `stg`.
#[derive(Clone, Copy, Debug)]
struct Seg {
    /// Index of the piece (copies never join two pieces: each device copy must stay inside
    /// one allocation, and two buffers may happen to be adjacent).
    piece: usize,
    src: Src,
    off: usize,
    len: usize,
    count: usize,
    stride: usize,
    pad: usize,
    stg: usize,
    dst: u64,
}

impl Seg {
    fn row(&self) -> usize {
        self.len + self.pad
    }

    fn bytes(&self) -> usize {
        self.row() * self.count
    }
}

/// How staged bytes are read from a shard file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
    /// `pread` of large ranges into the staging buffer (small rows still come from the mapping).
    Pread,
    /// `memcpy` from the memory mapping (page faults read the file).
    Mmap,
}

/// How the upload streams (defaults from the environment, see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct UploadOptions {
    pub io: Io,
    pub threads: usize,
    /// Bytes per staging buffer (raised to the longest strided row if smaller).
    pub chunk_bytes: usize,
}

impl UploadOptions {
    /// `MINIMAX_LOAD_IO`, `MINIMAX_LOAD_THREADS`, `MINIMAX_LOAD_CHUNK_MB`, else pread, the
    /// available cores (at most 16) and 128 MB.
    pub fn from_env() -> Self {
        let io = match std::env::var("MINIMAX_LOAD_IO").as_deref() {
            Ok("mmap") => Io::Mmap,
            _ => Io::Pread,
        };
        let threads = env_usize("MINIMAX_LOAD_THREADS").unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get()).min(16));
        Self { io, threads, chunk_bytes: env_usize("MINIMAX_LOAD_CHUNK_MB").unwrap_or(128) << 20 }
    }
}

fn env_usize(key: &str) -> Option<usize> {
    std::env::var(key).ok()?.trim().parse().ok().filter(|&v| v > 0)
}

/// Plans and executes the upload of one rank's weights; keeps the device buffers. Public
/// for the GPU tests (`tests/cuda_upload.rs`); `CudaModel::load_part` is its user.
pub struct Uploader<'a> {
    gpu: &'a Gpu,
    opts: UploadOptions,
    model: &'a GgufModel,
    bufs: Vec<CudaSlice<u8>>,
    pieces: Vec<Piece>,
    owned: Vec<Vec<u8>>,
    tensors: usize,
    t0: Instant,
}

impl<'a> Uploader<'a> {
    /// Starts a plan (the load's clock starts here).
    pub fn new(gpu: &'a Gpu, model: &'a GgufModel) -> Self {
        Self { gpu, opts: UploadOptions::from_env(), model, bufs: Vec::new(), pieces: Vec::new(), owned: Vec::new(), tensors: 0, t0: Instant::now() }
    }

    /// Replaces the options (tests: tiny staging buffers, each I/O mode).
    pub fn with_options(mut self, opts: UploadOptions) -> Self {
        self.opts = opts;
        self
    }

    /// A device buffer of `n` bytes (contents arrive at [`Uploader::finish`]).
    fn alloc(&mut self, n: usize) -> Result<u64, CudaError> {
        // SAFETY: every byte is written by the planned copies before the model runs.
        let b = unsafe { self.gpu.stream.alloc::<u8>(n.max(1)) }?;
        let p = self.gpu.ptr(&b);
        self.bufs.push(b);
        self.tensors += 1;
        Ok(p)
    }

    /// Offset of `data` (a view into shard `shard`) from the start of that shard's file.
    fn file_off(&self, shard: usize, data: &[u8]) -> usize {
        data.as_ptr() as usize - self.model.shards()[shard].bytes().as_ptr() as usize
    }

    fn owned(&mut self, bytes: Vec<u8>) -> Result<u64, CudaError> {
        let dst = self.alloc(bytes.len())?;
        self.pieces.push(Piece { src: Src::Owned(self.owned.len()), off: 0, len: bytes.len(), count: 1, stride: 0, pad: 0, dst });
        self.owned.push(bytes);
        Ok(dst)
    }

    /// A 2-D (or 3-D expert) matrix, uploaded in its quantized form.
    pub fn mat(&mut self, name: &str) -> Result<DevMat, CudaError> {
        self.mat_slice(name, None, None)
    }

    /// Rows `rows` (per expert, for a 3-D tensor) and columns `cols` of a matrix. Column
    /// slices keep the quantized blocks when block-aligned and fall back to f32 otherwise (as
    /// the CPU backend does).
    pub fn mat_slice(&mut self, name: &str, rows: Option<Range<usize>>, cols: Option<Range<usize>>) -> Result<DevMat, CudaError> {
        self.mat_slice_padded(name, rows, cols, |_| 1)
    }

    /// [`Uploader::mat_slice`] whose quantized column slices are stored with rows padded by
    /// zero bytes to a multiple of `row_multiple(type)` bytes (the fast decode kernels read
    /// whole chunks; `cols` stays the slice width, `row_bytes` is the padded stride).
    pub fn mat_slice_padded(
        &mut self,
        name: &str,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        row_multiple: impl Fn(GgmlType) -> usize,
    ) -> Result<DevMat, CudaError> {
        let t = self.model.tensor(name).ok_or_else(|| CudaError::MissingTensor(name.to_string()))?;
        let info = t.info;
        if !info.ty.is_supported() {
            return Err(CudaError::Unsupported { ty: info.ty, what: name.to_string() });
        }
        let ncols = info.row_len();
        let rb = quant::row_bytes(info.ty, ncols)?;
        let (nrows, n_experts) = match info.dims.len() {
            2 => (info.dims[1] as usize, 0),
            3 => (info.dims[1] as usize, info.dims[2] as usize),
            _ => return Err(CudaError::Shape(format!("{name}: {} dims", info.dims.len()))),
        };
        let r = rows.unwrap_or(0..nrows);
        let c = cols.unwrap_or(0..ncols);
        if r.end > nrows || c.end > ncols || r.start > r.end || c.start > c.end {
            return Err(CudaError::Shape(format!("{name}: rows {r:?} cols {c:?} of {nrows}x{ncols}")));
        }
        let ne = n_experts.max(1);
        if t.data.len() < ne * nrows * rb {
            return Err(CudaError::Shape(format!("{name}: {} bytes for {ne} x {nrows} rows of {rb}", t.data.len())));
        }
        let base = self.file_off(info.shard, t.data);
        let src = Src::Shard(info.shard);
        let (be, bb) = (info.ty.block_elems(), info.ty.block_bytes());
        let aligned = c.start % be == 0 && c.len() % be == 0;
        let (ty, w) = if aligned { (info.ty, quant::row_bytes(info.ty, c.len())?) } else { (GgmlType::F32, 4 * c.len()) };
        // Only strided quantized slices are padded (whole rows are already whole chunks or not
        // fast-path matrices; f32 conversions take the exact path anyway).
        let m = row_multiple(info.ty).max(1);
        let nrb = if aligned && c != (0..ncols) { w.div_ceil(m) * m } else { w };
        let n = ne * r.len() * nrb;
        let dst;
        if c == (0..ncols) {
            // Whole rows: one contiguous range per expert (one for the whole tensor when all
            // rows are taken).
            dst = self.alloc(n)?;
            if r == (0..nrows) {
                self.pieces.push(Piece { src, off: base, len: n, count: 1, stride: 0, pad: 0, dst });
            } else {
                for e in 0..ne {
                    let off = base + (e * nrows + r.start) * rb;
                    self.pieces.push(Piece { src, off, len: r.len() * rb, count: 1, stride: 0, pad: 0, dst: dst + (e * r.len() * rb) as u64 });
                }
            }
        } else if aligned {
            // Whole blocks of each row: strided rows per expert.
            dst = self.alloc(n)?;
            for e in 0..ne {
                let off = base + (e * nrows + r.start) * rb + c.start / be * bb;
                self.pieces.push(Piece { src, off, len: w, count: r.len(), stride: rb, pad: nrb - w, dst: dst + (e * r.len() * nrb) as u64 });
            }
        } else {
            let mut out = Vec::with_capacity(n);
            for e in 0..ne {
                for row in r.clone() {
                    let at = (e * nrows + row) * rb;
                    let v = quant::dequantize_to_vec(info.ty, &t.data[at..at + rb], ncols)?;
                    out.extend(v[c.clone()].iter().flat_map(|x| x.to_le_bytes()));
                }
            }
            dst = self.owned(out)?;
        }
        Ok(DevMat { ptr: dst, ty, rows: r.len(), cols: c.len(), row_bytes: nrb, n_experts, expert_stride: r.len() * nrb })
    }

    /// Elements `range` of a 1-D tensor as f32, on the device and on the host.
    pub fn vec_f32_range(&mut self, name: &str, range: Range<usize>) -> Result<(u64, Vec<f32>), CudaError> {
        let t = self.model.tensor(name).ok_or_else(|| CudaError::MissingTensor(name.to_string()))?;
        let v = quant::dequantize_to_vec(t.info.ty, t.data, t.info.n_elems() as usize)?;
        let v = v.get(range.clone()).ok_or_else(|| CudaError::Shape(format!("{name}: {range:?} of {}", v.len())))?.to_vec();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok((self.owned(bytes)?, v))
    }

    /// A 1-D tensor, converted to f32 on the host.
    pub fn vec_f32(&mut self, name: &str) -> Result<u64, CudaError> {
        let t = self.model.tensor(name).ok_or_else(|| CudaError::MissingTensor(name.to_string()))?;
        let v = quant::dequantize_to_vec(t.info.ty, t.data, t.info.n_elems() as usize)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.owned(bytes)
    }

    /// Bytes planned so far.
    pub fn planned_bytes(&self) -> usize {
        self.pieces.iter().map(Piece::bytes).sum()
    }

    /// Copies everything planned to the device and returns the buffers with the totals.
    pub fn finish(mut self) -> Result<(Vec<CudaSlice<u8>>, LoadStats), CudaError> {
        let total = self.planned_bytes();
        // Sequential file order (owned host bytes first); a piece's rows stay in order.
        self.pieces.sort_by_key(|p| (p.src, p.off));
        let UploadOptions { io, threads, chunk_bytes } = self.opts;
        let threads = threads.max(1);
        let cap = staging_cap(&self.pieces, chunk_bytes);
        let batches = plan_batches(&self.pieces, cap);
        let files = self.open_files(io);
        let g = self.gpu;
        // Allocations were made on the compute stream; the copy stream may use them only
        // once they are done.
        g.sync()?;
        g.ctx.bind_to_thread()?;
        let copy: Arc<CudaStream> = g.ctx.new_stream()?;
        let n_stg = N_STAGING.min(batches.len()).max(1);
        let mut staging: Vec<PinnedHostSlice<u8>> = Vec::with_capacity(n_stg);
        let mut done: Vec<CudaEvent> = Vec::with_capacity(n_stg);
        for _ in 0..n_stg {
            // SAFETY: staging bytes are written before they are read (by the copies).
            staging.push(unsafe { g.ctx.alloc_pinned_with_flags::<u8>(cap, 0) }?);
            done.push(g.ctx.new_event(None)?);
        }
        let stg_ptrs: Vec<usize> = staging.iter_mut().map(|s| s.as_mut_ptr().map(|p| p as usize)).collect::<Result<_, _>>()?;
        let t_io = Instant::now();
        tracing::info!(
            "weights: uploading {:.2} GB ({} tensors) through {n_stg} x {:.1} MB pinned buffers, {threads} threads, io {io:?}",
            total as f64 / 1e9,
            self.tensors,
            cap as f64 / (1 << 20) as f64
        );
        for b in 0..batches.len().min(3) {
            self.advise(&batches[b]);
        }
        let mut staged = 0usize;
        let mut last_log = Instant::now();
        for (i, batch) in batches.iter().enumerate() {
            let k = i % n_stg;
            // The buffer's previous copies to the device must be done before it is refilled.
            done[k].synchronize()?;
            if let Some(next) = batches.get(i + 3) {
                self.advise(next);
            }
            self.stage(batch, stg_ptrs[k], threads, &files)?;
            for s in merge_copies(batch) {
                // SAFETY: the staging range was filled above and stays untouched until `done[k]`
                // fires; the destination lies inside a buffer allocated for exactly this piece.
                let src = unsafe { std::slice::from_raw_parts((stg_ptrs[k] + s.0) as *const u8, s.2) };
                unsafe { cudarc::driver::result::memcpy_htod_async(s.1, src, copy.cu_stream()) }?;
            }
            done[k].record(&copy)?;
            staged += batch.iter().map(Seg::bytes).sum::<usize>();
            if last_log.elapsed() >= LOG_EVERY {
                last_log = Instant::now();
                let secs = t_io.elapsed().as_secs_f64().max(1e-9);
                let rate = staged as f64 / secs;
                tracing::info!(
                    "weights: {:.2}/{:.2} GB ({:.0}%), {:.2} GB/s, ETA {:.0} s",
                    staged as f64 / 1e9,
                    total as f64 / 1e9,
                    100.0 * staged as f64 / total.max(1) as f64,
                    rate / 1e9,
                    (total - staged) as f64 / rate.max(1.0)
                );
            }
        }
        copy.synchronize()?;
        drop(staging);
        let stats = LoadStats { tensors: self.tensors, bytes: total, seconds: self.t0.elapsed().as_secs_f64() };
        tracing::info!(
            "weights on {}: {} tensors, {:.3} GB in {:.2} s ({:.2} GB/s; reading + copying {:.2} s = {:.2} GB/s)",
            g.name,
            stats.tensors,
            total as f64 / 1e9,
            stats.seconds,
            stats.gb_per_s(),
            t_io.elapsed().as_secs_f64(),
            total as f64 / 1e9 / t_io.elapsed().as_secs_f64().max(1e-9)
        );
        Ok((std::mem::take(&mut self.bufs), stats))
    }

    /// Per shard, a file handle for `pread` (None: copy from the mapping, e.g. a model built
    /// in memory, or one whose file changed size since it was mapped).
    fn open_files(&self, io: Io) -> Vec<Option<File>> {
        self.model
            .shards()
            .iter()
            .map(|s| {
                if io != Io::Pread {
                    return None;
                }
                let f = File::open(s.path()).ok()?;
                (f.metadata().ok()?.len() == s.file_len() && s.bytes().len() as u64 == s.file_len()).then_some(f)
            })
            .collect()
    }

    /// Asks the kernel to start reading a batch's file ranges (page cache read-ahead).
    fn advise(&self, batch: &[Seg]) {
        const PAGE: usize = 4096;
        for s in batch {
            let Src::Shard(sh) = s.src else { continue };
            let bytes = self.model.shards()[sh].bytes();
            let lo = s.off / PAGE * PAGE;
            let hi = (s.off + (s.count - 1) * s.stride + s.len).min(bytes.len());
            if hi <= lo {
                continue;
            }
            // SAFETY: advice only; the range lies inside the shard's mapping (page-aligned
            // start, as madvise requires; a mapping starts on a page). Failure is harmless.
            unsafe {
                libc::madvise(bytes.as_ptr().add(lo) as *mut libc::c_void, hi - lo, libc::MADV_WILLNEED);
            }
        }
    }

    /// Fills staging buffer `stg` with `batch`, split over `threads` worker threads.
    fn stage(&self, batch: &[Seg], stg: usize, threads: usize, files: &[Option<File>]) -> Result<(), CudaError> {
        let shares = split_shares(batch, threads);
        let model = self.model;
        let owned = &self.owned;
        std::thread::scope(|sc| {
            let handles: Vec<_> = shares
                .into_iter()
                .map(|share| {
                    sc.spawn(move || -> Result<(), CudaError> {
                        for s in share {
                            // SAFETY: shares are disjoint ranges of the staging buffer, which
                            // no copy reads until this batch's copies are enqueued.
                            let out = unsafe { std::slice::from_raw_parts_mut((stg + s.stg) as *mut u8, s.bytes()) };
                            let (src, file, sh) = match s.src {
                                Src::Owned(i) => (&owned[i][..], None, 0),
                                Src::Shard(sh) => (model.shards()[sh].bytes(), files[sh].as_ref(), sh),
                            };
                            match file {
                                Some(f) if s.count == 1 && s.pad == 0 && s.len >= PREAD_MIN => {
                                    f.read_exact_at(out, s.off as u64)
                                        .map_err(|e| CudaError::Io { path: model.shards()[sh].path().display().to_string(), source: e })?;
                                }
                                _ => {
                                    copy_rows(out, src, &s);
                                }
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().expect("weight staging thread panicked"))
        })
    }
}

/// Copies a segment's rows from its source into its staging bytes `out`, each row followed by
/// its zero pad.
fn copy_rows(out: &mut [u8], src: &[u8], s: &Seg) {
    let rs = s.row();
    for r in 0..s.count {
        let at = s.off + r * s.stride;
        out[r * rs..r * rs + s.len].copy_from_slice(&src[at..at + s.len]);
        out[r * rs + s.len..(r + 1) * rs].fill(0);
    }
}

/// Bytes per staging buffer: `chunk` raised to the longest row of a strided piece (a row is
/// never split), at most everything planned, at least 1.
fn staging_cap(pieces: &[Piece], chunk: usize) -> usize {
    let total: usize = pieces.iter().map(Piece::bytes).sum();
    let max_row = pieces.iter().filter(|p| !p.contiguous()).map(Piece::row).max().unwrap_or(0);
    chunk.max(max_row).min(total.max(1)).max(1)
}

/// Cuts the pieces (in order) into batches of at most `cap` staged bytes. Contiguous ranges
/// split at any byte; strided rows split between rows (`cap` from [`staging_cap`], so every
/// row fits).
fn plan_batches(pieces: &[Piece], cap: usize) -> Vec<Vec<Seg>> {
    assert!(pieces.iter().all(|p| p.contiguous() || p.row() <= cap), "staging buffer smaller than a row");
    let mut out = Vec::new();
    let mut cur: Vec<Seg> = Vec::new();
    let mut used = 0usize;
    for (pi, p) in pieces.iter().enumerate().filter(|(_, p)| p.bytes() > 0) {
        if p.contiguous() {
            let mut done = 0;
            while done < p.len {
                if used == cap {
                    out.push(std::mem::take(&mut cur));
                    used = 0;
                }
                let take = (p.len - done).min(cap - used);
                cur.push(Seg { piece: pi, src: p.src, off: p.off + done, len: take, count: 1, stride: 0, pad: 0, stg: used, dst: p.dst + done as u64 });
                used += take;
                done += take;
            }
        } else {
            let mut row = 0;
            while row < p.count {
                let rs = p.row();
                if cap - used < rs {
                    out.push(std::mem::take(&mut cur));
                    used = 0;
                }
                let n = ((cap - used) / rs).min(p.count - row);
                cur.push(Seg { piece: pi, src: p.src, off: p.off + row * p.stride, len: p.len, count: n, stride: p.stride, pad: p.pad, stg: used, dst: p.dst + (row * rs) as u64 });
                used += n * rs;
                row += n;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Splits a batch into at most `n` shares of about equal bytes for the staging threads:
/// byte `x` of the batch goes to share `x * n / total` (contiguous segments split at any
/// byte, strided ones between rows, a row going with its first byte).
fn split_shares(batch: &[Seg], n: usize) -> Vec<Vec<Seg>> {
    let n = n.max(1);
    let total: usize = batch.iter().map(Seg::bytes).sum();
    let mut out: Vec<Vec<Seg>> = vec![Vec::new(); n];
    if total == 0 {
        return Vec::new();
    }
    let share_of = |x: usize| (x * n / total).min(n - 1);
    // First byte of share k + 1 (the end of share k).
    let share_end = |k: usize| if k + 1 == n { total } else { ((k + 1) * total).div_ceil(n) };
    let mut pos = 0usize;
    for s in batch {
        if s.count == 1 && s.pad == 0 {
            let mut done = 0;
            while done < s.len {
                let k = share_of(pos + done);
                let take = (s.len - done).min(share_end(k) - (pos + done)).max(1);
                out[k].push(Seg { off: s.off + done, len: take, stg: s.stg + done, dst: s.dst + done as u64, ..*s });
                done += take;
            }
        } else {
            let mut r = 0;
            while r < s.count {
                let rs = s.row();
                let start = pos + r * rs;
                let k = share_of(start);
                let rows = (share_end(k).saturating_sub(start)).div_ceil(rs).clamp(1, s.count - r);
                out[k].push(Seg { off: s.off + r * s.stride, count: rows, stg: s.stg + r * rs, dst: s.dst + (r * rs) as u64, ..*s });
                r += rows;
            }
        }
        pos += s.bytes();
    }
    out.retain(|v| !v.is_empty());
    out
}

/// The host-to-device copies of a batch as (staging offset, device address, bytes), joining
/// segments of one piece that continue each other in both places (a piece split between
/// threads). Segments of different pieces are never joined, even when their buffers happen
/// to be adjacent: a copy spanning two allocations is an invalid-value error.
fn merge_copies(batch: &[Seg]) -> Vec<(usize, u64, usize)> {
    let mut out: Vec<(usize, u64, usize)> = Vec::new();
    let mut last_piece = usize::MAX;
    for s in batch {
        let n = s.bytes();
        if let Some(last) = out.last_mut()
            && last_piece == s.piece
            && last.0 + last.2 == s.stg
            && last.1 + last.2 as u64 == s.dst
        {
            last.2 += n;
            continue;
        }
        out.push((s.stg, s.dst, n));
        last_piece = s.piece;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Executes a plan on the host: staging buffers of `cap` bytes, shares copied in order,
    /// copies applied to a flat "device" (address = index).
    fn run_on_host(pieces: &[Piece], src: &[u8], chunk: usize, threads: usize, dev_len: usize) -> Vec<u8> {
        let mut dev = vec![0xABu8; dev_len];
        let cap = staging_cap(pieces, chunk);
        for batch in plan_batches(pieces, cap) {
            let used: usize = batch.iter().map(Seg::bytes).sum();
            assert!(used <= cap, "batch of {used} > cap {cap}");
            let mut stg = vec![0xEEu8; cap];
            let shares = split_shares(&batch, threads);
            assert!(shares.len() <= threads, "{} shares for {threads} threads", shares.len());
            let covered: usize = shares.iter().flatten().map(Seg::bytes).sum();
            assert_eq!(covered, used);
            for s in shares.iter().flatten() {
                copy_rows(&mut stg[s.stg..s.stg + s.bytes()], src, s);
            }
            for (so, d, n) in merge_copies(&batch) {
                // Like cuMemcpyHtoD: a copy must stay inside one allocation (one piece).
                let inside = pieces.iter().any(|p| p.dst <= d && d + n as u64 <= p.dst + p.bytes() as u64);
                assert!(inside, "copy of {n} bytes at {d} spans two allocations");
                dev[d as usize..d as usize + n].copy_from_slice(&stg[so..so + n]);
            }
        }
        dev
    }

    #[test]
    fn plans_deliver_every_byte_of_contiguous_and_strided_pieces() {
        let src: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        // A contiguous range, strided rows (a column slice: 13 bytes of each 40-byte row, 300
        // rows), another contiguous range; destinations back to back.
        let pieces = [
            Piece { src: Src::Shard(0), off: 5, len: 9_001, count: 1, stride: 0, pad: 0, dst: 0 },
            Piece { src: Src::Shard(0), off: 10_007, len: 13, count: 300, stride: 40, pad: 0, dst: 9_001 },
            Piece { src: Src::Shard(0), off: 30_000, len: 4_444, count: 1, stride: 0, pad: 0, dst: 9_001 + 3_900 },
            // Padded rows (a tensor-parallel expert slice stored for the fast kernels): 11
            // bytes of each 30-byte row plus 5 zero bytes, 200 rows; and a single padded row.
            Piece { src: Src::Shard(0), off: 40_001, len: 11, count: 200, stride: 30, pad: 5, dst: 9_001 + 3_900 + 4_444 },
            Piece { src: Src::Shard(0), off: 47_000, len: 7, count: 1, stride: 0, pad: 9, dst: 9_001 + 3_900 + 4_444 + 3_200 },
        ];
        let dev_len = 9_001 + 3_900 + 4_444 + 3_200 + 16;
        let mut want = Vec::new();
        want.extend_from_slice(&src[5..9_006]);
        for r in 0..300 {
            want.extend_from_slice(&src[10_007 + r * 40..10_007 + r * 40 + 13]);
        }
        want.extend_from_slice(&src[30_000..34_444]);
        for r in 0..200 {
            want.extend_from_slice(&src[40_001 + r * 30..40_001 + r * 30 + 11]);
            want.extend_from_slice(&[0; 5]);
        }
        want.extend_from_slice(&src[47_000..47_007]);
        want.extend_from_slice(&[0; 9]);
        for cap in [13, 64, 1000, 4096, 100_000] {
            for threads in [1, 3, 16] {
                let got = run_on_host(&pieces, &src, cap, threads, dev_len);
                assert!(got == want, "cap {cap}, threads {threads}: first difference at {:?}", got.iter().zip(&want).position(|(a, b)| a != b));
            }
        }
    }

    #[test]
    fn strided_rows_merge_into_one_copy_per_batch() {
        let pieces = [Piece { src: Src::Shard(0), off: 0, len: 10, count: 1000, stride: 30, pad: 0, dst: 0 }];
        let batches = plan_batches(&pieces, 4096);
        assert_eq!(batches.len(), 3);
        for b in &batches {
            assert_eq!(merge_copies(b).len(), 1);
        }
    }
}
