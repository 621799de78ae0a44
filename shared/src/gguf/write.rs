//! A minimal GGUF v3 writer: builds test files (hostile-file tests, split sets, synthetic
//! models) with the same layout rules the reader enforces.

use super::value::MetaValue;
use crate::quant::GgmlType;

/// A tensor to write: ggml-order dims, its type and its already-encoded bytes.
pub struct TensorData {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: Vec<u8>,
}

/// A tensor described without its data (for [`GgufWriter::header_for`]).
pub struct TensorSpec<'a> {
    pub name: &'a str,
    pub dims: &'a [u64],
    pub ty: GgmlType,
    pub n_bytes: u64,
}

/// Collects metadata and tensors, then serialises them as one GGUF file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<TensorData>,
    alignment: u64,
}

fn value_type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(items) => {
            // An empty array's element type is irrelevant; write u8.
            let elem = items.first().map(value_type_id).unwrap_or(0);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
    }
}

impl GgufWriter {
    /// A writer with GGUF's default alignment (32).
    pub fn new() -> Self {
        Self { alignment: 32, ..Default::default() }
    }

    /// Adds a metadata key (written in insertion order). `general.alignment` also sets the
    /// alignment used for tensor data.
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        if key == "general.alignment"
            && let Some(a) = value.as_u64()
        {
            self.alignment = a.max(1);
        }
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push(TensorData { name: name.to_string(), dims: dims.to_vec(), ty, data });
        self
    }

    /// Serialises everything into GGUF v3 bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let specs: Vec<TensorSpec<'_>> = self.tensors.iter().map(|t| TensorSpec { name: &t.name, dims: &t.dims, ty: t.ty, n_bytes: t.data.len() as u64 }).collect();
        let (mut out, offsets) = self.header_for(&specs);
        let data_start = out.len() as u64;
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }

    /// The header alone (magic, this writer's metadata, the infos of `tensors`, padding up to
    /// the data section), so files too large for memory can be streamed: tensor `i`'s data
    /// starts `offsets[i]` bytes after the header, zero-padded in between. Tensors added with
    /// [`GgufWriter::tensor`] are ignored here.
    pub fn header_for(&self, tensors: &[TensorSpec<'_>]) -> (Vec<u8>, Vec<u64>) {
        let align = self.alignment;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut out, k);
            out.extend_from_slice(&value_type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(tensors.len());
        for t in tensors {
            put_string(&mut out, t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.n_bytes).div_ceil(align) * align;
        }
        let data_start = (out.len() as u64).div_ceil(align) * align;
        out.resize(data_start as usize, 0);
        (out, offsets)
    }
}
