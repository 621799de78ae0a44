//! GGUF reader: round trips through the writer, every error case a broken download or a
//! hostile file can produce, and a mutation fuzz that must never panic.

use std::path::{Path, PathBuf};

use minimax_shared::gguf::write::GgufWriter;
use minimax_shared::gguf::{GgufError, GgufFile, GgufModel, MetaValue};
use minimax_shared::quant::GgmlType;
use proptest::prelude::*;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("minimax-m2".into()))
        .meta("general.name", MetaValue::String("tiny".into()))
        .meta("test.u8", MetaValue::U8(7))
        .meta("test.i8", MetaValue::I8(-7))
        .meta("test.u16", MetaValue::U16(65535))
        .meta("test.i16", MetaValue::I16(-300))
        .meta("test.u32", MetaValue::U32(4_000_000_000))
        .meta("test.i32", MetaValue::I32(-5))
        .meta("test.u64", MetaValue::U64(u64::MAX))
        .meta("test.i64", MetaValue::I64(i64::MIN))
        .meta("test.f32", MetaValue::F32(1.5))
        .meta("test.f64", MetaValue::F64(-2.25))
        .meta("test.bool", MetaValue::Bool(true))
        .meta(
            "test.nested",
            MetaValue::Array(vec![
                MetaValue::Array(vec![MetaValue::I32(1), MetaValue::I32(2)]),
                MetaValue::Array(vec![MetaValue::I32(3)]),
            ]),
        )
        .meta("test.strings", MetaValue::Array(vec![MetaValue::String("a".into()), MetaValue::String("ü€".into())]));
    w.tensor("a.weight", &[4, 2], GgmlType::F32, f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]));
    w.tensor("b.weight", &[32], GgmlType::Q8_0, vec![0u8; 34]);
    w
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes("test.gguf", bytes)
}

#[test]
fn round_trip_every_value_type_and_tensor_bytes() {
    let f = parse(sample_writer().to_bytes()).unwrap();
    let m = f.metadata();
    assert_eq!(m.get("general.architecture").unwrap().as_str(), Some("minimax-m2"));
    assert_eq!(m.get("test.u8"), Some(&MetaValue::U8(7)));
    assert_eq!(m.get("test.i8"), Some(&MetaValue::I8(-7)));
    assert_eq!(m.get("test.u16"), Some(&MetaValue::U16(65535)));
    assert_eq!(m.get("test.i16"), Some(&MetaValue::I16(-300)));
    assert_eq!(m.get("test.u32").unwrap().as_u64(), Some(4_000_000_000));
    assert_eq!(m.get("test.i32").unwrap().as_i64(), Some(-5));
    assert_eq!(m.get("test.i32").unwrap().as_u64(), None);
    assert_eq!(m.get("test.u64").unwrap().as_u64(), Some(u64::MAX));
    assert_eq!(m.get("test.i64").unwrap().as_i64(), Some(i64::MIN));
    assert_eq!(m.get("test.f32").unwrap().as_f64(), Some(1.5));
    assert_eq!(m.get("test.f64").unwrap().as_f64(), Some(-2.25));
    assert_eq!(m.get("test.bool").unwrap().as_bool(), Some(true));
    let nested = m.get("test.nested").unwrap().as_array().unwrap();
    assert_eq!(nested[0].as_array().unwrap()[1], MetaValue::I32(2));
    assert_eq!(m.get("test.strings").unwrap().as_array().unwrap()[1].as_str(), Some("ü€"));
    let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
    assert_eq!(keys[0], "general.architecture", "file order is kept");
    assert_eq!(f.tensors().len(), 2);
    let a = &f.tensors()[0];
    assert_eq!(a.dims, vec![4, 2]);
    assert_eq!(a.n_rows(), 2);
    assert_eq!(a.row_len(), 4);
    assert_eq!(f.tensor_bytes(a), f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]).as_slice());
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.tensors()[1].offset % 32, 0);
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = sample_writer();
    w.meta("general.alignment", MetaValue::U32(64));
    let f = parse(w.to_bytes()).unwrap();
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensors()[1].offset, 64);
    let mut w = sample_writer();
    w.meta("general.alignment", MetaValue::U32(48));
    assert!(matches!(parse(w.to_bytes()), Err(GgufError::BadKey { .. })));
}

#[test]
fn bad_magic_and_version() {
    let mut b = sample_writer().to_bytes();
    b[0] = b'X';
    let e = parse(b).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("test.gguf"));
    let mut b = sample_writer().to_bytes();
    b[4] = 9;
    assert!(matches!(parse(b), Err(GgufError::BadVersion { version: 9, .. })));
}

#[test]
fn truncated_data_names_the_tensor() {
    let mut b = sample_writer().to_bytes();
    b.truncate(b.len() - 10);
    let e = parse(b).unwrap_err();
    match &e {
        GgufError::TensorPastEof { tensor, .. } => assert_eq!(tensor, "b.weight"),
        other => panic!("wrong error {other}"),
    }
    assert!(e.to_string().contains("truncated download"));
}

#[test]
fn truncated_header_names_the_offset() {
    let b = sample_writer().to_bytes();
    for cut in [3usize, 10, 30, 100, 200] {
        let e = parse(b[..cut].to_vec()).unwrap_err();
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::Malformed { .. } | GgufError::BadMagic { .. }),
            "cut {cut}: {e}"
        );
    }
}

#[test]
fn unknown_type_duplicate_names_and_misalignment() {
    // Unknown ggml type id: patch the type field of the first tensor info.
    let w = sample_writer();
    let b = w.to_bytes();
    let pos = find(&b, b"a.weight") + 8 + 4 + 16; // name, n_dims, 2 dims
    let mut bad = b.clone();
    bad[pos..pos + 4].copy_from_slice(&77u32.to_le_bytes());
    match parse(bad).unwrap_err() {
        GgufError::UnknownType { tensor, id, .. } => assert_eq!((tensor.as_str(), id), ("a.weight", 77)),
        e => panic!("{e}"),
    }
    let mut misaligned = b.clone();
    misaligned[pos + 4..pos + 12].copy_from_slice(&8u64.to_le_bytes());
    assert!(matches!(parse(misaligned), Err(GgufError::Misaligned { .. })));

    let mut w = GgufWriter::new();
    w.tensor("x", &[4], GgmlType::F32, vec![0; 16]).tensor("x", &[4], GgmlType::F32, vec![0; 16]);
    assert!(matches!(parse(w.to_bytes()), Err(GgufError::DuplicateTensor { .. })));

    let mut w = GgufWriter::new();
    w.meta("k", MetaValue::U8(1)).meta("k", MetaValue::U8(2));
    assert!(matches!(parse(w.to_bytes()), Err(GgufError::DuplicateKey { .. })));

    let mut w = GgufWriter::new();
    w.tensor("q", &[33], GgmlType::Q8_0, vec![0; 34]);
    let e = parse(w.to_bytes()).unwrap_err();
    assert!(e.to_string().contains("not a multiple"), "{e}");
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mmx-gguf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `count` shards of a model with `per_shard` tensors each, like gguf-split.
fn write_split(dir: &Path, prefix: &str, count: u16, per_shard: usize) {
    for i in 0..count {
        let mut w = GgufWriter::new();
        if i == 0 {
            w.meta("general.architecture", MetaValue::String("minimax-m2".into()));
        }
        w.meta("split.no", MetaValue::U16(i))
            .meta("split.count", MetaValue::U16(count))
            .meta("split.tensors.count", MetaValue::I32(count as i32 * per_shard as i32));
        for t in 0..per_shard {
            let v = (i as usize * per_shard + t) as f32;
            w.tensor(&format!("t{i}_{t}"), &[2], GgmlType::F32, f32_bytes(&[v, v + 0.5]));
        }
        std::fs::write(dir.join(format!("{prefix}-{:05}-of-{:05}.gguf", i + 1, count)), w.to_bytes()).unwrap();
    }
}

#[test]
fn split_models_open_from_dir_or_first_shard_for_any_count() {
    for count in [1u16, 2, 3, 5] {
        let d = tmpdir(&format!("split{count}"));
        write_split(&d, "m", count, 2);
        for m in [GgufModel::open(&d).unwrap(), GgufModel::open(d.join(format!("m-00001-of-{count:05}.gguf"))).unwrap()] {
            assert_eq!(m.shards().len(), count as usize);
            assert_eq!(m.tensor_count(), 2 * count as usize);
            assert_eq!(m.meta("general.architecture").unwrap().as_str(), Some("minimax-m2"));
            let last = format!("t{}_1", count - 1);
            let t = m.tensor(&last).unwrap();
            assert_eq!(t.info.shard, count as usize - 1);
            let v = (count as f32 - 1.) * 2. + 1.;
            assert_eq!(t.data, f32_bytes(&[v, v + 0.5]).as_slice());
        }
    }
}

#[test]
fn split_errors_missing_extra_and_mismatched_shards() {
    let d = tmpdir("missing");
    write_split(&d, "m", 3, 1);
    std::fs::remove_file(d.join("m-00002-of-00003.gguf")).unwrap();
    let e = GgufModel::open(&d).err().unwrap();
    assert!(matches!(e, GgufError::MissingShard { .. }), "{e}");
    assert!(e.to_string().contains("m-00002-of-00003.gguf"), "{e}");

    let d = tmpdir("extra");
    write_split(&d, "m", 2, 1);
    std::fs::copy(d.join("m-00002-of-00002.gguf"), d.join("m-00003-of-00003.gguf")).unwrap();
    let e = GgufModel::open(d.join("m-00001-of-00002.gguf")).err().unwrap();
    assert!(matches!(e, GgufError::ExtraShard { .. }), "{e}");

    // Shards renamed into the wrong order: split.no disagrees with the file name.
    let d = tmpdir("order");
    write_split(&d, "m", 2, 1);
    std::fs::rename(d.join("m-00001-of-00002.gguf"), d.join("tmp")).unwrap();
    std::fs::rename(d.join("m-00002-of-00002.gguf"), d.join("m-00001-of-00002.gguf")).unwrap();
    std::fs::rename(d.join("tmp"), d.join("m-00002-of-00002.gguf")).unwrap();
    let e = GgufModel::open(&d).err().unwrap();
    assert!(matches!(e, GgufError::ShardMismatch { .. }), "{e}");

    // Opening a later shard is refused with a pointer to the first.
    let d = tmpdir("later");
    write_split(&d, "m", 2, 1);
    let e = GgufModel::open(d.join("m-00002-of-00002.gguf")).err().unwrap();
    assert!(e.to_string().contains("m-00001-of-00002.gguf"), "{e}");

    // A lone shard renamed to look unsplit still declares split.count = 3.
    let d = tmpdir("lone");
    write_split(&d, "m", 3, 1);
    std::fs::rename(d.join("m-00001-of-00003.gguf"), d.join("lone.gguf")).unwrap();
    let e = GgufModel::open(d.join("lone.gguf")).err().unwrap();
    assert!(matches!(e, GgufError::MissingShard { .. }), "{e}");

    // split.tensors.count disagreeing with the tensors found.
    let d = tmpdir("count");
    let mut w = GgufWriter::new();
    w.meta("split.no", MetaValue::U16(0))
        .meta("split.count", MetaValue::U16(1))
        .meta("split.tensors.count", MetaValue::I32(5))
        .tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    std::fs::write(d.join("m-00001-of-00001.gguf"), w.to_bytes()).unwrap();
    let e = GgufModel::open(&d).err().unwrap();
    assert!(e.to_string().contains("split.tensors.count"), "{e}");

    let d = tmpdir("empty");
    assert!(matches!(GgufModel::open(&d), Err(GgufError::NoModelFile { .. })));
    assert!(matches!(GgufModel::open(d.join("nope.gguf")), Err(GgufError::Io { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    /// Random byte flips, truncations and insertions in a valid file never panic and never
    /// hand out tensor bytes outside the buffer.
    #[test]
    fn mutated_files_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut b = sample_writer().to_bytes();
        for (i, v) in flips {
            let i = i.index(b.len());
            b[i] = v;
        }
        if do_cut {
            let c = cut.index(b.len());
            b.truncate(c);
        }
        if let Ok(f) = parse(b) {
            for t in f.tensors() {
                prop_assert_eq!(f.tensor_bytes(t).len() as u64, t.n_bytes);
            }
        }
    }

    /// Huge counts and lengths in headers are rejected without allocating them.
    #[test]
    fn huge_counts_are_rejected(n in 1u64 << 40..u64::MAX) {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        prop_assert!(parse(b).is_err());
    }
}
