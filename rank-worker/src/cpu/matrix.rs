//! A weight matrix in its GGUF quantized form: rows of `cols` elements, multiplied block by
//! block. Row slices stay zero-copy in the memory map; column slices (tensor parallelism)
//! are copied, as whole blocks when the split is block-aligned and as f32 otherwise.

use std::ops::Range;
use std::sync::Arc;

use minimax_shared::gguf::GgufModel;
use minimax_shared::quant::{self, GgmlType};

use super::error::CpuError;

/// Where a matrix's bytes live.
#[derive(Clone)]
enum Storage {
    /// A byte range of one shard of the memory-mapped model.
    Mapped { model: Arc<GgufModel>, shard: usize, start: usize, len: usize },
    Owned(Arc<[u8]>),
}

/// A row-major quantized matrix (`rows` x `cols`, each row `row_bytes` bytes).
#[derive(Clone)]
pub struct Matrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    storage: Storage,
}

impl Matrix {
    /// Rows `rows` of tensor `name` (outer dimensions flattened: row `e * n + r` of a 3-D
    /// expert tensor is row `r` of expert `e`), without copying.
    pub fn rows(model: &Arc<GgufModel>, name: &str, rows: Range<usize>) -> Result<Self, CpuError> {
        let t = model.tensor(name).ok_or_else(|| CpuError::MissingTensor(name.to_string()))?;
        let info = t.info;
        if rows.end > info.n_rows() || rows.start > rows.end {
            return Err(CpuError::Shape(format!("{name}: rows {rows:?} of {}", info.n_rows())));
        }
        let row_bytes = info.row_bytes();
        let file = &model.shards()[info.shard];
        let base = t.data.as_ptr() as usize - file.bytes().as_ptr() as usize;
        Ok(Self {
            ty: info.ty,
            rows: rows.len(),
            cols: info.row_len(),
            row_bytes,
            storage: Storage::Mapped {
                model: model.clone(),
                shard: info.shard,
                start: base + rows.start * row_bytes,
                len: rows.len() * row_bytes,
            },
        })
    }

    /// Columns `cols` of rows `rows` of tensor `name`, copied out.
    pub fn cols(model: &Arc<GgufModel>, name: &str, rows: Range<usize>, cols: Range<usize>) -> Result<Self, CpuError> {
        let full = Self::rows(model, name, rows)?;
        if cols == (0..full.cols) {
            return Ok(full);
        }
        if cols.end > full.cols || cols.start > cols.end {
            return Err(CpuError::Shape(format!("{name}: columns {cols:?} of {}", full.cols)));
        }
        let be = full.ty.block_elems();
        let data = full.bytes();
        let n = cols.len();
        let (ty, bytes) = if cols.start % be == 0 && n % be == 0 {
            let bb = full.ty.block_bytes();
            let (b0, b1) = (cols.start / be * bb, cols.end / be * bb);
            let mut out = Vec::with_capacity(full.rows * (b1 - b0));
            for r in 0..full.rows {
                out.extend_from_slice(&data[r * full.row_bytes + b0..r * full.row_bytes + b1]);
            }
            (full.ty, out)
        } else {
            let mut row = vec![0f32; full.cols];
            let mut out = Vec::with_capacity(full.rows * n * 4);
            for r in 0..full.rows {
                full.row_f32(r, &mut row)?;
                out.extend(row[cols.clone()].iter().flat_map(|x| x.to_le_bytes()));
            }
            (GgmlType::F32, out)
        };
        let row_bytes = quant::row_bytes(ty, n)?;
        Ok(Self { ty, rows: full.rows, cols: n, row_bytes, storage: Storage::Owned(bytes.into()) })
    }

    /// The matrix's bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped { model, shard, start, len } => &model.shards()[*shard].bytes()[*start..*start + *len],
            Storage::Owned(b) => b,
        }
    }

    /// Size in bytes.
    pub fn n_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Row `r` dequantized into `out` (`cols` long).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) -> Result<(), CpuError> {
        let b = &self.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes];
        quant::dequantize(self.ty, b, out)?;
        Ok(())
    }

    /// `y = W x` for one input vector.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) -> Result<(), CpuError> {
        quant::matvec(self.ty, self.bytes(), self.rows, self.cols, x, y)?;
        Ok(())
    }
}

/// A 1-D F32 tensor (norm weights, router bias) read fully, sliced to `range` if given.
pub fn vector(model: &GgufModel, name: &str, range: Option<Range<usize>>) -> Result<Vec<f32>, CpuError> {
    let t = model.tensor(name).ok_or_else(|| CpuError::MissingTensor(name.to_string()))?;
    let n = t.info.n_elems() as usize;
    let v = quant::dequantize_to_vec(t.info.ty, t.data, n)?;
    Ok(match range {
        Some(r) => v[r].to_vec(),
        None => v,
    })
}
