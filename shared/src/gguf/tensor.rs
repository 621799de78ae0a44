//! Tensor descriptions and zero-copy views of their bytes.

use crate::quant::GgmlType;

/// A tensor as the GGUF header describes it. `dims` are in ggml order: `dims[0]` is the
/// contiguous (row) dimension, so a PyTorch `[out, in]` weight is stored as `[in, out]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of its file's data section.
    pub offset: u64,
    pub n_bytes: u64,
    /// Index of the shard (file) that holds the data.
    pub shard: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }

    /// Number of rows of length `dims[0]` (all outer dimensions flattened).
    pub fn n_rows(&self) -> usize {
        (self.n_elems() / self.dims[0]) as usize
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        (self.n_bytes / self.n_rows() as u64) as usize
    }
}

/// A tensor's description together with its bytes in the mapped file.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}
