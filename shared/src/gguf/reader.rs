//! A bounds-checked cursor over GGUF header bytes. Every read names what it was reading so
//! that a truncated or hostile file produces a precise error instead of a panic.

use std::path::Path;

use super::error::GgufError;
use super::value::MetaValue;

/// Nesting depth allowed for arrays of arrays; real files use one level.
const MAX_ARRAY_DEPTH: u32 = 8;

pub(crate) struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(path: &'a Path, bytes: &'a [u8]) -> Self {
        Self { path, bytes, pos: 0 }
    }

    pub(crate) fn pos(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub(crate) fn truncated(&self, what: &str) -> GgufError {
        GgufError::Truncated { path: self.path.to_path_buf(), offset: self.pos as u64, what: what.to_string() }
    }

    pub(crate) fn malformed(&self, what: &str, detail: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            what: what.to_string(),
            detail: detail.into(),
        }
    }

    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must be satisfiable by the bytes left, each item taking at least
    /// `min_item_bytes`: stops hostile headers from asking for huge allocations.
    pub(crate) fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let max = (self.remaining() / min_item_bytes.max(1)) as u64;
        if n > max {
            return Err(self.malformed(what, format!("count {n} cannot fit in the {} bytes left", self.remaining())));
        }
        Ok(n as usize)
    }

    pub(crate) fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.truncated(what));
        }
        let start = self.pos;
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| GgufError::Malformed {
            path: self.path.to_path_buf(),
            offset: start as u64,
            what: what.to_string(),
            detail: format!("not valid UTF-8: {e}"),
        })
    }

    pub(crate) fn value(&mut self, type_id: u32, what: &str, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match type_id {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.malformed(what, format!("bool byte {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed(what, "arrays nested too deeply"));
                }
                let elem_type = self.u32(what)?;
                let min = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4 | 5 | 6 => 4,
                    8 | 9 | 10 | 11 | 12 => 8,
                    t => return Err(self.malformed(what, format!("unknown array element type {t}"))),
                };
                let n = self.count(what, min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_type, what, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            t => return Err(self.malformed(what, format!("unknown metadata value type {t}"))),
        })
    }
}
