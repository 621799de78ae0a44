//! GGUF v3 reading: memory-mapped files, split shards, metadata and zero-copy tensor bytes.

mod error;
mod file;
mod model;
mod reader;
mod tensor;
mod value;
pub mod write;

pub use error::GgufError;
pub use file::GgufFile;
pub use model::GgufModel;
pub use tensor::{TensorInfo, TensorView};
pub use value::{MetaValue, Metadata};
