//! ModelConfig from real fixture files, and the precise errors for missing or inconsistent
//! keys, wrong shapes and unsupported quant types.

use std::path::PathBuf;

use minimax_shared::gguf::write::GgufWriter;
use minimax_shared::gguf::{GgufModel, MetaValue};
use minimax_shared::model::{ConfigError, GatingFunc, ModelConfig};
use minimax_shared::quant::GgmlType;

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(p)
}

#[test]
fn fixture_configs_read_from_metadata() {
    let m = GgufModel::open(fixture("m2-small/q8_0.gguf")).unwrap();
    let c = ModelConfig::from_gguf(&m).unwrap();
    assert_eq!((c.n_layers, c.hidden, c.n_heads, c.n_kv_heads), (4, 256, 4, 2));
    assert_eq!((c.head_dim, c.v_head_dim, c.rotary_dim), (64, 64, 32));
    assert_eq!((c.n_experts, c.n_experts_used, c.expert_ff), (16, 4, 32));
    assert_eq!((c.vocab_size, c.context_length), (1000, 4096));
    assert_eq!(c.gating, GatingFunc::Sigmoid);
    assert_eq!(c.rope_theta, 50000.0);
    assert!(!c.tied_embeddings);

    let odd = ModelConfig::from_gguf(&GgufModel::open(fixture("m2-odd/kmix.gguf")).unwrap()).unwrap();
    assert_eq!((odd.n_heads, odd.n_kv_heads, odd.head_dim, odd.rotary_dim), (6, 2, 32, 24));
    assert_eq!((odd.n_layers, odd.n_experts, odd.n_experts_used, odd.vocab_size), (3, 20, 3, 600));

    let split = GgufModel::open(fixture("m2-small/split")).unwrap();
    assert_eq!(split.shards().len(), 3);
    assert_eq!(ModelConfig::from_gguf(&split).unwrap().n_layers, 4);
}

/// Re-writes a fixture with metadata and tensors edited by the callbacks.
fn rewrite(
    src: &str,
    edit_meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    edit_tensor: impl Fn(&str, &[u64], GgmlType, &[u8]) -> Option<(Vec<u64>, GgmlType, Vec<u8>)>,
) -> GgufModel {
    let m = GgufModel::open(fixture(src)).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in m.metadata().iter() {
        if let Some(v) = edit_meta(k, v) {
            w.meta(k, v);
        }
    }
    for t in m.tensors() {
        let view = m.tensor(&t.name).unwrap();
        if let Some((dims, ty, data)) = edit_tensor(&t.name, &t.dims, t.ty, view.data) {
            w.tensor(&t.name, &dims, ty, data);
        }
    }
    let dir = std::env::temp_dir().join(format!("mmx-cfg-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("edited.gguf");
    std::fs::write(&p, w.to_bytes()).unwrap();
    GgufModel::open(&p).unwrap()
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn keep_tensor(_: &str, d: &[u64], ty: GgmlType, b: &[u8]) -> Option<(Vec<u64>, GgmlType, Vec<u8>)> {
    Some((d.to_vec(), ty, b.to_vec()))
}

#[test]
fn missing_and_bad_keys_are_named() {
    for key in ["minimax-m2.attention.head_count_kv", "minimax-m2.expert_used_count", "minimax-m2.rope.dimension_count", "general.architecture"] {
        let m = rewrite("m2-small/kmix.gguf", |k, v| (k != key).then(|| v.clone()), keep_tensor);
        let e = ModelConfig::from_gguf(&m).unwrap_err();
        assert!(matches!(&e, ConfigError::MissingKey(k) if k == key), "{key}: {e}");
        assert!(e.to_string().contains(key));
    }
    let m = rewrite(
        "m2-small/kmix.gguf",
        |k, v| Some(if k == "minimax-m2.attention.head_count_kv" { MetaValue::U32(3) } else { v.clone() }),
        keep_tensor,
    );
    let e = ModelConfig::from_gguf(&m).unwrap_err();
    assert!(e.to_string().contains("head_count_kv"), "{e}");
    let m = rewrite(
        "m2-small/kmix.gguf",
        |k, v| Some(if k == "minimax-m2.block_count" { MetaValue::String("four".into()) } else { v.clone() }),
        keep_tensor,
    );
    let e = ModelConfig::from_gguf(&m).unwrap_err();
    assert!(e.to_string().contains("minimax-m2.block_count") && e.to_string().contains("string"), "{e}");
    let m = rewrite(
        "m2-small/kmix.gguf",
        |k, v| Some(if k == "general.architecture" { MetaValue::String("llama".into()) } else { v.clone() }),
        keep_tensor,
    );
    assert!(matches!(ModelConfig::from_gguf(&m), Err(ConfigError::Architecture(a)) if a == "llama"));
}

#[test]
fn tensor_shape_missing_tensor_and_unsupported_type() {
    // A block count larger than the tensors present: the first missing tensor is named.
    let m = rewrite(
        "m2-small/kmix.gguf",
        |k, v| Some(if k == "minimax-m2.block_count" { MetaValue::U32(5) } else { v.clone() }),
        keep_tensor,
    );
    let e = ModelConfig::from_gguf(&m).unwrap_err();
    assert!(e.to_string().contains("blk.4."), "{e}");

    // Wrong expert width in metadata: shape error names the tensor and both shapes.
    let m = rewrite(
        "m2-small/kmix.gguf",
        |k, v| Some(if k == "minimax-m2.expert_feed_forward_length" { MetaValue::U32(64) } else { v.clone() }),
        keep_tensor,
    );
    let e = ModelConfig::from_gguf(&m).unwrap_err();
    assert!(matches!(&e, ConfigError::Shape { tensor, .. } if tensor == "blk.0.ffn_gate_exps.weight"), "{e}");

    // An IQ2_XS tensor (valid size, zero bytes) is refused with the type and tensor named.
    let m = rewrite("m2-small/kmix.gguf", |_, v| Some(v.clone()), |name, d, ty, b| {
        if name == "blk.1.ffn_up_exps.weight" {
            let n: u64 = d.iter().product();
            Some((d.to_vec(), GgmlType::IQ2_XS, vec![0u8; GgmlType::IQ2_XS.bytes_for(n).unwrap() as usize]))
        } else {
            Some((d.to_vec(), ty, b.to_vec()))
        }
    });
    let e = ModelConfig::from_gguf(&m).unwrap_err();
    assert_eq!(e.to_string(), "not yet supported: IQ2_XS in blk.1.ffn_up_exps.weight");
}
