//! A model as users download it: one GGUF file or a set of `NAME-0000i-of-0000N.gguf` shards.
//! Only shard 0 carries the full metadata; every shard carries the `split.*` keys.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::error::GgufError;
use super::file::GgufFile;
use super::tensor::{TensorInfo, TensorView};
use super::value::{MetaValue, Metadata};

/// All shards of one model with a single tensor index over them.
pub struct GgufModel {
    shards: Vec<GgufFile>,
    index: HashMap<String, (usize, usize)>,
}

/// The pieces of a shard file name `PREFIX-00001-of-00003.gguf`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SplitName {
    prefix: String,
    no: u32,
    count: u32,
}

fn parse_split_name(path: &Path) -> Option<SplitName> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    if no.len() != 5 || count.len() != 5 || !no.bytes().all(|b| b.is_ascii_digit()) || !count.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(SplitName { prefix: prefix.to_string(), no: no.parse().ok()?, count: count.parse().ok()? })
}

fn shard_path(dir: &Path, prefix: &str, no: u32, count: u32) -> PathBuf {
    dir.join(format!("{prefix}-{no:05}-of-{count:05}.gguf"))
}

fn gguf_files_in(dir: &Path) -> Result<Vec<PathBuf>, GgufError> {
    let io = |source| GgufError::Io { path: dir.to_path_buf(), source };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.extension().is_some_and(|e| e == "gguf") && p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Decides which files make up the model at `path` (a file, a first shard, or a directory).
fn resolve_shards(path: &Path) -> Result<Vec<PathBuf>, GgufError> {
    let (dir, first) = if path.is_dir() {
        let files = gguf_files_in(path)?;
        let firsts: Vec<&PathBuf> = files.iter().filter(|f| parse_split_name(f).is_some_and(|s| s.no == 1)).collect();
        let plain: Vec<&PathBuf> = files.iter().filter(|f| parse_split_name(f).is_none()).collect();
        match (firsts.as_slice(), plain.as_slice()) {
            ([], []) => return Err(GgufError::NoModelFile { path: path.to_path_buf() }),
            ([], [one]) => return Ok(vec![(*one).clone()]),
            ([one], _) => (path.to_path_buf(), (*one).clone()),
            _ => {
                return Err(GgufError::ExtraShard {
                    path: path.to_path_buf(),
                    detail: format!(
                        "the directory holds several models ({}); name the file to load",
                        files.iter().filter_map(|f| f.file_name()?.to_str()).collect::<Vec<_>>().join(", ")
                    ),
                });
            }
        }
    } else {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
        (dir, path.to_path_buf())
    };

    let Some(split) = parse_split_name(&first) else {
        return Ok(vec![first]);
    };
    if split.no != 1 {
        return Err(GgufError::ShardMismatch {
            path: first,
            detail: format!("load a split model from its first shard ({}), not shard {}", shard_path(&dir, &split.prefix, 1, split.count).display(), split.no),
        });
    }
    if split.count == 0 {
        return Err(GgufError::ShardMismatch { path: first, detail: "shard count 0 in file name".into() });
    }
    let shards: Vec<PathBuf> = (1..=split.count).map(|i| shard_path(&dir, &split.prefix, i, split.count)).collect();
    for s in &shards {
        if !s.is_file() {
            return Err(GgufError::MissingShard { expected: s.clone(), count: split.count });
        }
    }
    // Same prefix, different numbering: a second download mixed into the folder.
    for f in gguf_files_in(&dir)? {
        if let Some(other) = parse_split_name(&f)
            && other.prefix == split.prefix
            && (other.count != split.count || other.no > split.count)
        {
            return Err(GgufError::ExtraShard {
                path: f,
                detail: format!("expected shards 1..={} of {}", split.count, split.count),
            });
        }
    }
    Ok(shards)
}

fn split_key(file: &GgufFile, key: &str) -> Result<Option<u64>, GgufError> {
    match file.metadata().get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| GgufError::BadKey {
            path: file.path().to_path_buf(),
            key: key.to_string(),
            detail: format!("expected a non-negative integer, found {}", v.type_name()),
        }),
    }
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel").field("shards", &self.shards).finish()
    }
}

impl GgufModel {
    /// Opens a single file, the first shard of a split model, or a directory holding either.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let paths = resolve_shards(path.as_ref())?;
        let shards = paths.iter().map(GgufFile::open).collect::<Result<Vec<_>, _>>()?;
        Self::from_shards(shards)
    }

    /// Assembles already-parsed shards (in order), checking the `split.*` keys of each.
    pub fn from_shards(mut shards: Vec<GgufFile>) -> Result<Self, GgufError> {
        let count = shards.len() as u64;
        for (i, shard) in shards.iter().enumerate() {
            let declared = split_key(shard, "split.count")?;
            let no = split_key(shard, "split.no")?;
            match (declared, no) {
                (None, None) if count == 1 => {}
                (None, _) | (_, None) if count > 1 => {
                    return Err(GgufError::ShardMismatch {
                        path: shard.path().to_path_buf(),
                        detail: "missing split.count / split.no in a split model".into(),
                    });
                }
                (Some(c), _) if c != count => {
                    if c > count && count == 1 {
                        return Err(GgufError::MissingShard { expected: shard.path().to_path_buf(), count: c as u32 });
                    }
                    return Err(GgufError::ShardMismatch {
                        path: shard.path().to_path_buf(),
                        detail: format!("split.count = {c}, but {count} shard(s) were found"),
                    });
                }
                (_, Some(n)) if n != i as u64 => {
                    return Err(GgufError::ShardMismatch {
                        path: shard.path().to_path_buf(),
                        detail: format!("split.no = {n}, but this is shard {i} (0-based) by its file name"),
                    });
                }
                _ => {}
            }
        }
        let mut index = HashMap::new();
        let mut first_seen: HashMap<String, PathBuf> = HashMap::new();
        for (s, shard) in shards.iter_mut().enumerate() {
            let path = shard.path().to_path_buf();
            for (t, info) in shard.tensors_mut().iter_mut().enumerate() {
                info.shard = s;
                if let Some(first) = first_seen.get(&info.name) {
                    return Err(GgufError::DuplicateTensor { path, tensor: info.name.clone(), first: first.clone() });
                }
                first_seen.insert(info.name.clone(), path.clone());
                index.insert(info.name.clone(), (s, t));
            }
        }
        if let Some(expected) = split_key(&shards[0], "split.tensors.count")?
            && expected != index.len() as u64
        {
            return Err(GgufError::ShardMismatch {
                path: shards[0].path().to_path_buf(),
                detail: format!("split.tensors.count = {expected}, but the shards hold {} tensors", index.len()),
            });
        }
        Ok(Self { shards, index })
    }

    /// The model's metadata (shard 0's; the others only carry `split.*`).
    pub fn metadata(&self) -> &Metadata {
        self.shards[0].metadata()
    }

    /// A metadata value by key.
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata().get(key)
    }

    /// The shard files, in order.
    pub fn shards(&self) -> &[GgufFile] {
        &self.shards
    }

    /// Every tensor across shards, shard by shard in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.shards.iter().flat_map(|s| s.tensors().iter())
    }

    /// Number of tensors across shards.
    pub fn tensor_count(&self) -> usize {
        self.index.len()
    }

    /// Looks a tensor up by name, with its bytes.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let &(s, t) = self.index.get(name)?;
        let shard = &self.shards[s];
        let info = &shard.tensors()[t];
        Some(TensorView { info, data: shard.tensor_bytes(info) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names_parse() {
        let s = parse_split_name(Path::new("/m/MiniMax-M2-Q4_K_M-00002-of-00005.gguf")).unwrap();
        assert_eq!(s, SplitName { prefix: "MiniMax-M2-Q4_K_M".into(), no: 2, count: 5 });
        assert!(parse_split_name(Path::new("model.gguf")).is_none());
        assert!(parse_split_name(Path::new("a-1-of-3.gguf")).is_none());
        assert_eq!(shard_path(Path::new("/m"), "x", 3, 12), PathBuf::from("/m/x-00003-of-00012.gguf"));
    }
}
