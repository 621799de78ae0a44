//! Typed errors for reading GGUF files: each names the file and, where there is one, the
//! tensor or key and the byte offset, because users debug broken downloads from these.

use std::path::PathBuf;

use crate::quant::GgmlType;

/// Everything that can be wrong with a GGUF file or a set of split shards.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    BadVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated at byte {offset} while reading {what}")]
    Truncated { path: PathBuf, offset: u64, what: String },
    #[error("{path}: {what} at byte {offset}: {detail}")]
    Malformed { path: PathBuf, offset: u64, what: String, detail: String },
    #[error("{path}: tensor '{tensor}' has unknown ggml type id {id}")]
    UnknownType { path: PathBuf, tensor: String, id: u32 },
    #[error("{path}: tensor '{tensor}': {detail}")]
    BadTensor { path: PathBuf, tensor: String, detail: String },
    #[error(
        "{path}: tensor '{tensor}' data [{start}, {end}) lies past the end of the file ({file_len} bytes): truncated download?"
    )]
    TensorPastEof { path: PathBuf, tensor: String, start: u64, end: u64, file_len: u64 },
    #[error("{path}: tensor '{tensor}' offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { path: PathBuf, tensor: String, offset: u64, alignment: u64 },
    #[error("{path}: duplicate tensor name '{tensor}' (first seen in {first})")]
    DuplicateTensor { path: PathBuf, tensor: String, first: PathBuf },
    #[error("{path}: duplicate metadata key '{key}'")]
    DuplicateKey { path: PathBuf, key: String },
    #[error("{path}: metadata key '{key}': {detail}")]
    BadKey { path: PathBuf, key: String, detail: String },
    #[error("split model: missing shard {expected} (split.count = {count})")]
    MissingShard { expected: PathBuf, count: u32 },
    #[error("split model: {path} does not belong to the set: {detail}")]
    ExtraShard { path: PathBuf, detail: String },
    #[error("{path}: shard numbering mismatch: {detail}")]
    ShardMismatch { path: PathBuf, detail: String },
    #[error("{path}: no .gguf file found")]
    NoModelFile { path: PathBuf },
    #[error("{path}: tensor '{tensor}' uses {ty}, which is not yet supported")]
    UnsupportedType { path: PathBuf, tensor: String, ty: GgmlType },
}
