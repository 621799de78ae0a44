//! One GGUF file: header, metadata, tensor infos and the memory-mapped data section.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::error::GgufError;
use super::reader::Reader;
use super::tensor::TensorInfo;
use super::value::Metadata;
use crate::quant::GgmlType;

const MAGIC: [u8; 4] = *b"GGUF";
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;

/// Where a file's bytes live: a read-only memory map, or an owned buffer (tests, fuzzing).
#[derive(Clone)]
pub enum Bytes {
    Mapped(Arc<Mmap>),
    Owned(Arc<[u8]>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(b) => b,
        }
    }
}

/// A parsed GGUF file; tensor data stays in the mapping and is handed out zero-copy.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; model files are not modified while served, and a
        // concurrent truncation is the same hazard every mmap-based loader (llama.cpp) accepts.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Bytes::Mapped(Arc::new(mmap)))
    }

    /// Parses a file already in memory; `path` only labels errors.
    pub fn from_bytes(path: impl AsRef<Path>, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(path.as_ref(), Bytes::Owned(bytes.into()))
    }

    fn parse(path: &Path, bytes: Bytes) -> Result<Self, GgufError> {
        let buf = bytes.as_slice();
        let mut r = Reader::new(path, buf);
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(GgufError::BadMagic { path: path.to_path_buf(), found: magic });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::BadVersion { path: path.to_path_buf(), version });
        }
        // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes,
        // a key/value at least 8 (key len) + 4 (type) + 1.
        let n_tensors = r.count("tensor count", 24)?;
        let n_kv = r.count("metadata count", 13)?;

        let mut metadata = Metadata::default();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let type_id = r.u32(&format!("type of metadata key '{key}'"))?;
            let value = r.value(type_id, &format!("value of metadata key '{key}'"), 0)?;
            if !metadata.insert(key.clone(), value) {
                return Err(GgufError::DuplicateKey { path: path.to_path_buf(), key });
            }
        }

        let alignment = metadata.alignment();
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(GgufError::BadKey {
                path: path.to_path_buf(),
                key: "general.alignment".into(),
                detail: format!("{alignment} is not a power of two"),
            });
        }

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut seen: HashMap<String, ()> = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor #{i}"))?;
            let what = format!("tensor '{name}'");
            let n_dims = r.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.malformed(&what, format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let type_id = r.u32(&what)?;
            let offset = r.u64(&what)?;
            let ty = GgmlType::from_id(type_id)
                .ok_or_else(|| GgufError::UnknownType { path: path.to_path_buf(), tensor: name.clone(), id: type_id })?;
            let bad = |detail: String| GgufError::BadTensor { path: path.to_path_buf(), tensor: name.clone(), detail };
            let n_elems = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            if dims.contains(&0) {
                return Err(bad(format!("zero-sized dimension in {dims:?}")));
            }
            if dims[0] % ty.block_elems() as u64 != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {} block size {}",
                    dims[0],
                    ty,
                    ty.block_elems()
                )));
            }
            let n_bytes = ty.bytes_for(n_elems).ok_or_else(|| bad(format!("size of {dims:?} overflows")))?;
            if offset % alignment != 0 {
                return Err(GgufError::Misaligned { path: path.to_path_buf(), tensor: name, offset, alignment });
            }
            if seen.insert(name.clone(), ()).is_some() {
                return Err(GgufError::DuplicateTensor {
                    path: path.to_path_buf(),
                    tensor: name,
                    first: path.to_path_buf(),
                });
            }
            tensors.push(TensorInfo { name, dims, ty, offset, n_bytes, shard: 0 });
        }

        let data_offset = r.pos().div_ceil(alignment) * alignment;
        let file_len = buf.len() as u64;
        for t in &tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(_), Some(end)) if end <= file_len => {}
                _ => {
                    return Err(GgufError::TensorPastEof {
                        path: path.to_path_buf(),
                        tensor: t.name.clone(),
                        start: data_offset.saturating_add(t.offset),
                        end: data_offset.saturating_add(t.offset).saturating_add(t.n_bytes),
                        file_len,
                    });
                }
            }
        }

        Ok(Self { path: path.to_path_buf(), bytes, version, metadata, tensors, data_offset })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The key/value metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub(crate) fn tensors_mut(&mut self) -> &mut [TensorInfo] {
        &mut self.tensors
    }

    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total file size.
    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    /// The whole file's bytes (for zero-copy views that outlive a `TensorView` borrow).
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// The raw bytes of a tensor of this file (bounds were checked at parse time).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.bytes.as_slice()[start..start + info.n_bytes as usize]
    }
}
