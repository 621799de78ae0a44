//! The CPU reference forward pass against transformers' logits for every fixture variant:
//! whole sequences, and batches mixing sequences with different cached prefixes, chunked
//! prefill and decode over scattered KV pages.

mod common;

use std::sync::Arc;

use common::{max_diff, variants};
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

const PAGE: usize = 16;

fn load(path: &std::path::Path, n_pages: usize) -> CpuModel {
    let m = Arc::new(GgufModel::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&m).unwrap();
    CpuModel::load(m, Partition::whole(&cfg), KvSpec { page_size: PAGE, n_pages }).unwrap()
}

#[test]
fn whole_sequences_match_transformers() {
    for v in variants() {
        let mut model = load(&v.gguf, 64);
        for (si, seq) in v.sequences.iter().enumerate() {
            let pages: Vec<u32> = (0..seq.len().div_ceil(PAGE) as u32).collect();
            let batch = ForwardBatch {
                seqs: vec![SeqStep { seq_id: 1, page_table: pages, cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::All }],
            };
            let out = model.forward(&batch, &Solo).unwrap();
            assert_eq!(out.rows.len(), seq.len());
            let d = max_diff(&out.logits, &v.logits[si]);
            assert!(d <= v.tolerance(), "{}/{} seq len {}: max |diff| {d}", v.model, v.name, seq.len());
            eprintln!("{}/{} len {}: max |diff| {d:.2e}", v.model, v.name, seq.len());
        }
    }
}

/// Physical pages handed out in a scrambled order so page-table indirection is exercised.
struct Pages {
    free: Vec<u32>,
}

impl Pages {
    fn new(n: u32) -> Self {
        // A fixed permutation: multiply by a unit modulo n.
        Self { free: (0..n).map(|i| (i * 37 + 11) % n).collect() }
    }
    fn grow(&mut self, table: &mut Vec<u32>, len: usize) {
        while table.len() * PAGE < len {
            table.push(self.free.pop().unwrap());
        }
    }
}

#[test]
fn mixed_batches_with_cached_prefixes_match_transformers() {
    for v in variants().into_iter().filter(|v| v.name != "kmix-split") {
        let n_pages = 64u32;
        let mut model = load(&v.gguf, n_pages as usize);
        let mut pages = Pages::new(n_pages);
        let seqs = &v.sequences; // lengths 1, 7, 64, 300
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
        let mut done = vec![0usize; seqs.len()];
        // Each step: (sequence, number of new tokens, logits wanted). Sequences advance by
        // chunks of different sizes, several per step, decode steps mixed with prefill chunks.
        let schedule: Vec<Vec<(usize, usize, LogitsWanted)>> = vec![
            vec![(3, 100, LogitsWanted::None), (1, 3, LogitsWanted::All)],
            vec![(2, 40, LogitsWanted::Last), (1, 1, LogitsWanted::Last), (0, 1, LogitsWanted::All), (3, 57, LogitsWanted::All)],
            vec![(1, 3, LogitsWanted::All), (2, 1, LogitsWanted::Last), (3, 1, LogitsWanted::Last)],
            vec![(3, 142, LogitsWanted::All), (2, 23, LogitsWanted::All)],
        ];
        let mut checked = 0;
        for step in schedule {
            let mut batch = ForwardBatch::default();
            for &(s, n, want) in &step {
                let start = done[s];
                pages.grow(&mut tables[s], start + n);
                batch.seqs.push(SeqStep {
                    seq_id: s as u64,
                    page_table: tables[s].clone(),
                    cached_len: start,
                    tokens: seqs[s][start..start + n].to_vec(),
                    logits: want,
                });
                done[s] += n;
            }
            let out = model.forward(&batch, &Solo).unwrap();
            for (i, row) in out.rows.iter().enumerate() {
                let s = step[row.seq].0;
                let reference = &v.logits[s][row.position * v.vocab..(row.position + 1) * v.vocab];
                let d = max_diff(out.row(i), reference);
                assert!(d <= v.tolerance(), "{}/{} seq {s} pos {}: max |diff| {d}", v.model, v.name, row.position);
                checked += 1;
            }
        }
        assert_eq!(done, seqs.iter().map(Vec::len).collect::<Vec<_>>(), "schedule covers every token");
        assert!(checked >= 233, "only {checked} rows checked");
    }
}

#[test]
fn invalid_batches_are_rejected_before_touching_the_cache() {
    let v = &variants()[0];
    let mut model = load(&v.gguf, 4);
    let seq = &v.sequences[2]; // 64 tokens = 4 pages of 16
    let ok = ForwardBatch {
        seqs: vec![SeqStep { seq_id: 1, page_table: vec![0, 1, 2, 3], cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::Last }],
    };
    let first = model.forward(&ok, &Solo).unwrap();
    let bad_cases = vec![
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 0, tokens: vec![], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 0, tokens: vec![v.vocab as u32], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 16, tokens: vec![1], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![9], cached_len: 0, tokens: vec![1], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0; 300], cached_len: 4096, tokens: vec![1], logits: LogitsWanted::Last },
    ];
    for bad in bad_cases {
        let e = model.forward(&ForwardBatch { seqs: vec![bad.clone()] }, &Solo).unwrap_err();
        eprintln!("rejected: {e}");
    }
    // Two sequences writing the same page.
    let clash = ForwardBatch {
        seqs: vec![
            SeqStep { seq_id: 7, page_table: vec![0], cached_len: 0, tokens: vec![1], logits: LogitsWanted::None },
            SeqStep { seq_id: 8, page_table: vec![0], cached_len: 0, tokens: vec![2], logits: LogitsWanted::None },
        ],
    };
    assert!(model.forward(&clash, &Solo).unwrap_err().to_string().contains("same KV page"));
    // The cache still holds the first sequence intact: recomputing its last token from the
    // cache gives the same logits.
    let again = ForwardBatch {
        seqs: vec![SeqStep { seq_id: 1, page_table: vec![0, 1, 2, 3], cached_len: 63, tokens: vec![seq[63]], logits: LogitsWanted::Last }],
    };
    let second = model.forward(&again, &Solo).unwrap();
    assert!(max_diff(&first.logits, &second.logits) < 1e-5);
}
