//! The CUDA forward against the transformers reference logits and the CPU backend, for every
//! fixture variant: whole sequences, mixed batches over scattered pages with cached prefixes,
//! and greedy generation (32 tokens, batched and unbatched) identical to the CPU's.
//! Needs a GPU: run with `--ignored` (tools/gpu/run_tests.sh does).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::{argmax, max_diff, variants};
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use minimax_rank::cuda::{CudaModel, CudaOptions, KvDtype};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

const PAGE: usize = 16;
/// Max |logit - reference| allowed: f32 activations, f16 KV cache (about 5e-4 relative per
/// cached value), f32 accumulation in a different order than the CPU; logits are O(10).
const TOL: f32 = 2e-2;

/// A synthetic model of MiniMax-M2.7's real widths (`desc` as `--synthetic` takes it), with
/// `n_pages` KV pages and weights from `seed`.
fn synthetic(desc: &str, n_pages: usize, seed: u64) -> CudaModel {
    let spec = minimax_shared::model::synthetic::SyntheticSpec::parse(desc).unwrap();
    CudaModel::synthetic(&spec, KvSpec { page_size: PAGE, n_pages }, CudaOptions::default(), seed).unwrap()
}

fn gpu_model(path: &std::path::Path, n_pages: usize, kv_dtype: KvDtype) -> CudaModel {
    let m = Arc::new(GgufModel::open(path).unwrap());
    CudaModel::load(m, KvSpec { page_size: PAGE, n_pages }, CudaOptions { device: 0, kv_dtype, ..Default::default() }).unwrap()
}

fn cpu_model(path: &std::path::Path, n_pages: usize) -> CpuModel {
    let m = Arc::new(GgufModel::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&m).unwrap();
    CpuModel::load(m, Partition::whole(&cfg), KvSpec { page_size: PAGE, n_pages }).unwrap()
}

/// Per fixture variant, per sequence, per position: the transformers model's smallest gap
/// (over layers) between the k-th and (k+1)-th biased router choice.
fn routing_margins(model: &str, variant: &str) -> Vec<Vec<f32>> {
    let path = common::fixtures_dir().join(model).join("reference.json");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let key = variant.trim_end_matches("-split");
    r["routing_margins"][key]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_array().unwrap().iter().map(|m| m.as_f64().unwrap() as f32).collect())
        .collect()
}

/// Positions whose router top-k is this close to a tie may legitimately route differently
/// when K/V are rounded to 16 bits (a relative change of ~1e-3 in the attention output).
const NEAR_TIE: f32 = 2e-3;
/// A logits difference this large means the token took a different expert set.
const FLIP: f32 = 0.5;
/// Allowed difference at positions after a routing flip in their sequence.
const LOOSE: f32 = 0.15;

#[test]
#[ignore = "needs a CUDA GPU"]
fn whole_sequences_match_reference_for_every_variant() {
    for v in variants() {
        let margins = routing_margins(&v.model, &v.name);
        for dt in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let mut model = gpu_model(&v.gguf, 64, dt);
            let st = model.load_stats();
            let (mut worst, mut worst_clean, mut over, mut total) = (0f32, 0f32, Vec::new(), 0);
            for (si, seq) in v.sequences.iter().enumerate() {
                let pages: Vec<u32> = (0..seq.len().div_ceil(PAGE) as u32).collect();
                let batch = ForwardBatch {
                    seqs: vec![SeqStep { seq_id: 1, page_table: pages, cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::All }],
                };
                let out = model.forward(&batch).unwrap();
                assert_eq!(out.rows.len(), seq.len());
                assert!(out.logits.iter().all(|x| x.is_finite()), "{}/{}: non-finite logits", v.model, v.name);
                for p in 0..seq.len() {
                    let d = max_diff(out.row(p), &v.logits[si][p * v.vocab..(p + 1) * v.vocab]);
                    worst = worst.max(d);
                    total += 1;
                    if d > TOL {
                        over.push((si, p, d, margins[si][p]));
                    } else {
                        worst_clean = worst_clean.max(d);
                    }
                }
            }
            eprintln!(
                "{}/{:<10} kv {dt:?}: max |diff| vs reference {worst:.2e}; {} of {total} positions over {TOL:.0e} {:?} (load {} tensors, {:.1} MB, {:.2} GB/s)",
                v.model,
                v.name,
                over.len(),
                over.iter().take(6).map(|&(s, p, d, m)| format!("seq {s} pos {p}: diff {d:.2} margin {m:.1e}")).collect::<Vec<_>>(),
                st.tensors,
                st.bytes as f64 / 1e6,
                st.gb_per_s()
            );
            match dt {
                // f32 KV: every position within tolerance.
                KvDtype::F32 => assert!(over.is_empty(), "{}/{} kv f32: {over:?}", v.model, v.name),
                // bf16 KV (8 significant bits) re-routes many tokens of these random tiny
                // models, whose router margins are small: reported, not asserted.
                KvDtype::BF16 => {}
                // f16 KV: a router near-tie may route a token differently (a jump in its
                // logits); every such jump must sit at a near-tie, every position before the
                // first one must be within tolerance, and later positions (which attend to
                // the re-routed token's K/V) within LOOSE.
                KvDtype::F16 => {
                    for &(s, p, d, m) in &over {
                        let first_flip = over.iter().filter(|o| o.0 == s && o.2 > FLIP).map(|o| o.1).min();
                        if d > FLIP {
                            assert!(m < NEAR_TIE, "{}/{} kv {dt:?} seq {s} pos {p}: jump {d} away from a routing near-tie (margin {m})", v.model, v.name);
                        } else {
                            assert!(first_flip.is_some_and(|f| p > f) && d <= LOOSE, "{}/{} kv {dt:?} seq {s} pos {p}: diff {d} not explained by an earlier routing flip", v.model, v.name);
                        }
                    }
                    assert!(over.iter().filter(|o| o.2 > FLIP).count() * 50 <= total, "{}/{} kv {dt:?}: too many routing flips", v.model, v.name);
                }
            }
        }
    }
}

/// Physical pages handed out in a scrambled order so page-table indirection is exercised.
struct Pages {
    free: Vec<u32>,
}

impl Pages {
    fn new(n: u32) -> Self {
        Self { free: (0..n).map(|i| (i * 37 + 11) % n).collect() }
    }
    fn grow(&mut self, table: &mut Vec<u32>, len: usize) {
        while table.len() * PAGE < len {
            table.push(self.free.pop().unwrap());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mixed_batches_with_cached_prefixes_match_reference() {
    for v in variants().into_iter().filter(|v| v.name != "kmix-split") {
        let n_pages = 64u32;
        let mut model = gpu_model(&v.gguf, n_pages as usize, KvDtype::F32);
        let mut pages = Pages::new(n_pages);
        let seqs = &v.sequences;
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
        let mut done = vec![0usize; seqs.len()];
        let schedule: Vec<Vec<(usize, usize, LogitsWanted)>> = vec![
            vec![(3, 100, LogitsWanted::None), (1, 3, LogitsWanted::All)],
            vec![(2, 40, LogitsWanted::Last), (1, 1, LogitsWanted::Last), (0, 1, LogitsWanted::All), (3, 57, LogitsWanted::All)],
            vec![(1, 3, LogitsWanted::All), (2, 1, LogitsWanted::Last), (3, 1, LogitsWanted::Last)],
            vec![(3, 142, LogitsWanted::All), (2, 23, LogitsWanted::All)],
        ];
        let (mut checked, mut worst) = (0, 0f32);
        for step in schedule {
            let mut batch = ForwardBatch::default();
            for &(s, n, want) in &step {
                let start = done[s];
                pages.grow(&mut tables[s], start + n);
                batch.seqs.push(SeqStep { seq_id: s as u64, page_table: tables[s].clone(), cached_len: start, tokens: seqs[s][start..start + n].to_vec(), logits: want });
                done[s] += n;
            }
            let out = model.forward(&batch).unwrap();
            for (i, row) in out.rows.iter().enumerate() {
                let s = step[row.seq].0;
                let reference = &v.logits[s][row.position * v.vocab..(row.position + 1) * v.vocab];
                let d = max_diff(out.row(i), reference);
                assert!(d <= TOL, "{}/{} seq {s} pos {}: max |diff| {d}", v.model, v.name, row.position);
                worst = worst.max(d);
                checked += 1;
            }
        }
        assert!(checked >= 233, "only {checked} rows checked");
        eprintln!("{}/{:<6} mixed batches: {checked} rows, max |diff| {worst:.2e}", v.model, v.name);
    }
}

/// Greedy continuation of `prompts` for `n` tokens; `batched` runs every sequence in one
/// batch per step, otherwise one sequence at a time. Returns tokens and the smallest top-2 gap.
fn generate(forward: &mut dyn FnMut(&ForwardBatch) -> Vec<Vec<f32>>, prompts: &[Vec<u32>], n: usize, batched: bool) -> (Vec<Vec<u32>>, f32) {
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut min_gap = f32::INFINITY;
    let tables: Vec<Vec<u32>> = (0..prompts.len()).map(|s| (0..8u32).map(|p| s as u32 * 8 + p).collect()).collect();
    let groups: Vec<Vec<usize>> = if batched { vec![(0..prompts.len()).collect()] } else { (0..prompts.len()).map(|s| vec![s]).collect() };
    for group in groups {
        for step in 0..n {
            let mut batch = ForwardBatch::default();
            for &s in &group {
                let (cached, tokens) = if step == 0 {
                    (0, prompts[s].clone())
                } else {
                    (prompts[s].len() + step - 1, vec![*out[s].last().unwrap()])
                };
                batch.seqs.push(SeqStep { seq_id: s as u64, page_table: tables[s].clone(), cached_len: cached, tokens, logits: LogitsWanted::Last });
            }
            let rows = forward(&batch);
            for (i, &s) in group.iter().enumerate() {
                let (t, gap) = argmax(&rows[i]);
                min_gap = min_gap.min(gap);
                out[s].push(t);
            }
        }
    }
    (out, min_gap)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_generation_is_identical_to_cpu_batched_and_unbatched() {
    const N: usize = 32;
    for v in variants().into_iter().filter(|v| v.name != "kmix-split") {
        let prompts: Vec<Vec<u32>> = v.sequences.iter().map(|s| s[..s.len().min(7)].to_vec()).collect();
        let mut cpu_runs = Vec::new();
        for batched in [false, true] {
            let mut cpu = cpu_model(&v.gguf, 64);
            let (ct, cgap) = generate(&mut |b| { let o = cpu.forward(b, &Solo).unwrap(); (0..o.rows.len()).map(|i| o.row(i).to_vec()).collect() }, &prompts, N, batched);
            cpu_runs.push(ct.clone());
            for dt in [KvDtype::F32, KvDtype::F16] {
                let mut gpu = gpu_model(&v.gguf, 64, dt);
                let (gt, ggap) = generate(&mut |b| { let o = gpu.forward(b).unwrap(); (0..o.rows.len()).map(|i| o.row(i).to_vec()).collect() }, &prompts, N, batched);
                let same = (0..prompts.len()).filter(|&s| gt[s] == ct[s]).count();
                eprintln!(
                    "{}/{:<6} batched={batched:<5} kv {dt:?}: {same} of {} sequences x {N} greedy tokens identical to CPU (min top-2 gap cpu {cgap:.1e}, gpu {ggap:.1e})",
                    v.model, v.name, prompts.len()
                );
                if dt == KvDtype::F32 {
                    for s in 0..prompts.len() {
                        assert_eq!(gt[s], ct[s], "{}/{} seq {s} batched={batched}: GPU vs CPU tokens", v.model, v.name);
                    }
                }
            }
        }
        assert_eq!(cpu_runs[0], cpu_runs[1], "{}/{}: CPU batched and unbatched differ", v.model, v.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_batched_and_unbatched_decode_agree_bit_for_bit() {
    for v in variants().into_iter().filter(|v| v.name == "kmix") {
        let prompts: Vec<Vec<u32>> = v.sequences.iter().map(|s| s[..s.len().min(7)].to_vec()).collect();
        let mut runs = Vec::new();
        for batched in [false, true] {
            let mut gpu = gpu_model(&v.gguf, 64, KvDtype::F16);
            let (gt, _) = generate(&mut |b| { let o = gpu.forward(b).unwrap(); (0..o.rows.len()).map(|i| o.row(i).to_vec()).collect() }, &prompts, 32, batched);
            runs.push(gt);
        }
        assert_eq!(runs[0], runs[1], "{}/{}: GPU batched vs unbatched", v.model, v.name);
        eprintln!("{}/{}: kv F16 greedy tokens identical batched and unbatched", v.model, v.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn invalid_batches_are_rejected_before_touching_the_cache() {
    let v = &variants()[0];
    let mut model = gpu_model(&v.gguf, 4, KvDtype::F16);
    let seq = &v.sequences[2];
    let ok = ForwardBatch { seqs: vec![SeqStep { seq_id: 1, page_table: vec![0, 1, 2, 3], cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::Last }] };
    let first = model.forward(&ok).unwrap();
    let bad_cases = vec![
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 0, tokens: vec![], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 0, tokens: vec![v.vocab as u32], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0], cached_len: 16, tokens: vec![1], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![9], cached_len: 0, tokens: vec![1], logits: LogitsWanted::Last },
        SeqStep { seq_id: 2, page_table: vec![0; 300], cached_len: 4096, tokens: vec![1], logits: LogitsWanted::Last },
    ];
    // The last token recomputed as a one-token step over the cache: the reference for the
    // same step after the bad batches (the 64-token prefill above takes the tensor-core GEMM
    // and flash attention, so it is compared within the prefill tolerance, not bit for bit).
    let again = ForwardBatch { seqs: vec![SeqStep { seq_id: 1, page_table: vec![0, 1, 2, 3], cached_len: 63, tokens: vec![seq[63]], logits: LogitsWanted::Last }] };
    let before = model.forward(&again).unwrap();
    assert!(max_diff(&first.logits, &before.logits) < 2e-2);
    for bad in bad_cases {
        assert!(model.forward(&ForwardBatch { seqs: vec![bad] }).is_err());
    }
    let second = model.forward(&again).unwrap();
    let d = max_diff(&before.logits, &second.logits);
    assert!(d < 1e-6, "recomputed last token differs by {d}");
    eprintln!("invalid batches rejected; cache intact (recomputed logits within {d:.1e})");
}

/// The fast decode path at real MiniMax-M2.7 dimensions (synthetic IQ4_XS weights, 2 layers):
/// with the attention merge folded into the split kernel (`attn_dec6m`, `MINIMAX_ATTN_FUSE=1`)
/// the logits of one- and several-token steps are bit-identical to the separate launches,
/// directly and replayed from the step graphs (persistent expert kernels in every run).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_fused_launches_are_bit_identical() {
    use minimax_rank::cuda::fast::set_attn_fusion;
    let mut m = synthetic("m2.7:iq4xs:2", 64, 7);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let prompt: Vec<u32> = vec![1, 17, 4242, 99_999, 200_000];
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut base = 0u32;
    for (fused, graphs) in [(false, false), (true, false), (true, true), (false, true)] {
        set_attn_fusion(Some(fused));
        m.clear_graphs();
        m.set_fast(true, graphs);
        let pt: Vec<u32> = (base..base + 4).collect();
        let pt2: Vec<u32> = (base + 4..base + 8).collect();
        base += 8;
        let step = |seq: u64, pt: &[u32], cached: usize, tokens: Vec<u32>| SeqStep { seq_id: seq, page_table: pt.to_vec(), cached_len: cached, tokens, logits: LogitsWanted::Last };
        let mut out = Vec::new();
        let o = m.forward(&ForwardBatch { seqs: vec![step(0, &pt, 0, prompt.clone()), step(1, &pt2, 0, prompt[..3].to_vec())] }).unwrap();
        out.push(o.logits.clone());
        let (mut tok, tok2) = (argmax(o.row(0)).0, argmax(o.row(1)).0);
        // One-token steps, one two-token step, one-token steps.
        for cached in [5usize, 6, 7, 8, 9, 10] {
            let seqs = if cached == 8 { vec![step(0, &pt, cached, vec![tok]), step(1, &pt2, 3, vec![tok2])] } else { vec![step(0, &pt, cached, vec![tok])] };
            let o = m.forward(&ForwardBatch { seqs }).unwrap();
            tok = argmax(o.row(0)).0;
            out.push(o.logits.clone());
        }
        assert!(out.iter().all(|l| l.iter().all(|x| x.is_finite())), "fused {fused} graphs {graphs}: non-finite logits");
        runs.push(out);
    }
    set_attn_fusion(None);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, name) in [(1, "fused"), (2, "fused + graphs"), (3, "separate + graphs")] {
        for (s, (a, b)) in runs[0].iter().zip(&runs[i]).enumerate() {
            assert!(bits(a) == bits(b), "{name} step {s}: logits differ from separate launches (max |diff| {})", max_diff(a, b));
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: fused / fused + graphs / separate + graphs bit-identical to separate launches over {} steps", runs[0].len());
}

/// Unsplit decode attention at short contexts (`fast::set_attn_short`, `MINIMAX_ATTN_SHORT`):
/// a step whose contexts are all at most `ATTN_SHORT_MAX_CTX` runs `attn_dec6tm_*` with one
/// split and no `attn_merge6`; a longer context keeps the split kernels and the merge. Logits
/// match the split form up to f32 rounding (other summation order) and the greedy tokens are
/// the same, directly and from the step graphs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_short_context_attention_matches_split_form() {
    use minimax_rank::cuda::fast::{ATTN_SHORT_MAX_CTX, set_attn_short};
    let mut m = synthetic("m2.7:iq4xs:2", 200, 13);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    // Kernels of one direct (no graph) one-token step at context `cached + 1`.
    let kernels_at = |m: &mut CudaModel, short: bool, cached: usize, base: u32| -> Vec<String> {
        set_attn_short(Some(short));
        let pt: Vec<u32> = (base..base + (cached + 2).div_ceil(PAGE) as u32).collect();
        let prompt: Vec<u32> = (0..cached as u32).map(|i| (i * 7919 + 3) % 200_000).collect();
        one_token_step_kernels(m, 900 + base as u64, pt, prompt, 5)
    };
    let has = |ks: &[String], p: &str| ks.iter().any(|k| k.starts_with(p));
    // The merging form: attn_dec6tm_*, or attn_dec6tnm_* with the q/k norms inside (fast::qk_fuse).
    let merged = |ks: &[String]| has(ks, "attn_dec6tm_") || has(ks, "attn_dec6tnm_");
    let ks = kernels_at(&mut m, true, 40, 0);
    assert!(merged(&ks) && !has(&ks, "attn_merge6"), "short context, attn_short on: {ks:?}");
    let ks = kernels_at(&mut m, false, 40, 10);
    assert!(has(&ks, "attn_merge6") && !merged(&ks), "short context, attn_short off: {ks:?}");
    let ks = kernels_at(&mut m, true, ATTN_SHORT_MAX_CTX + 20, 20);
    assert!(has(&ks, "attn_merge6"), "context past ATTN_SHORT_MAX_CTX keeps the split form: {ks:?}");
    // The step series with and without, direct and from graphs.
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, (short, graphs)) in [(false, false), (true, false), (true, true)].into_iter().enumerate() {
        set_attn_short(Some(short));
        m.clear_graphs();
        m.set_fast(true, graphs);
        runs.push(fast_step_series(&mut m, 60 + 20 * i as u32));
    }
    set_attn_short(None);
    m.set_fast(true, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut worst = 0f32;
    for (s, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_diff(a, b);
        assert!(d.is_finite() && d <= 1e-3 * scale.max(1.0), "step {s}: unsplit attention logits off by {d} (|logit| <= {scale})");
        worst = worst.max(d / scale.max(1.0));
        for (ra, rb) in a.chunks(spec_vocab(&m)).zip(b.chunks(spec_vocab(&m))) {
            assert_eq!(argmax(ra).0, argmax(rb).0, "step {s}: greedy token differs with unsplit attention");
        }
    }
    for (s, (a, b)) in runs[1].iter().zip(&runs[2]).enumerate() {
        assert!(bits(a) == bits(b), "step {s}: unsplit attention from graphs differs from direct launches (max |diff| {})", max_diff(a, b));
    }
    eprintln!("m2.7:iq4xs:2 fast path: unsplit short-context attention within {worst:.1e} (relative to the largest logit) of the split form, greedy tokens identical, graphs bit-identical to direct");
}

/// The MoE norm inside the router (`router_topk_f32n`: q8 groups and sums of squares spread over
/// the router's blocks, the scale applied by its last block) at M2.7 dimensions (2 layers): its
/// steps launch no MoE `norm_q8`; logits within 1e-3 of the largest logit of `norm_q8` +
/// `router_topk_f32x` and the same greedy tokens over steps of 1, 2 and 5 tokens; graphs
/// bit-identical to direct launches.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_normless_router_matches_norm_and_router() {
    use minimax_rank::cuda::fast::{set_route_inline, set_router_normless};
    // The router's own top-k (inline routing in the gate/up has its own test).
    set_route_inline(Some(false));
    // The Q8_0-head mix: the f32 rounding of the two forms can flip a near-tie in the top-k
    // (then the logits move by ~1e-2, past this test's bound); with the Q6_K-head mix's random
    // weights one does at step 4 (session 26), with these weights none does.
    let mut m = synthetic("m2.7:iq4xs-q8out:2", 200, 19);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let kernels = |m: &mut CudaModel, on: bool, base: u32| -> Vec<String> {
        set_router_normless(Some(on));
        one_token_step_kernels(m, 800 + base as u64, (base..base + 2).collect(), vec![3, 5, 7], 11)
    };
    // The kernel, its early-trigger form (`e`) or its 16-warp blocks (`16`).
    let count = |ks: &[String], p: &str| ks.iter().filter(|k| k.as_str() == p || k.starts_with(&format!("{p}e")) || k.as_str() == format!("{p}16")).count();
    let on = kernels(&mut m, true, 0);
    let off = kernels(&mut m, false, 4);
    assert!(count(&on, "router_topk_f32n") == 2 && count(&on, "router_topk_f32x") == 0, "normless router: {on:?}");
    assert!(count(&off, "router_topk_f32x") == 2 && count(&on, "norm_q8") + 2 == count(&off, "norm_q8"), "one norm_q8 a layer fewer: {on:?} against {off:?}");
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, (on, graphs)) in [(false, false), (true, false), (true, true)].into_iter().enumerate() {
        set_router_normless(Some(on));
        m.clear_graphs();
        m.set_fast(true, graphs);
        runs.push(fast_step_series(&mut m, 40 + 20 * i as u32));
    }
    set_router_normless(None);
    set_route_inline(None);
    m.clear_graphs();
    m.set_fast(true, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut worst = 0f32;
    for (s, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert!(b.iter().all(|x| x.is_finite()), "step {s}: non-finite logits with the normless router");
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_diff(a, b);
        assert!(d.is_finite() && d <= 1e-3 * scale.max(1.0), "step {s}: normless router logits off by {d} (|logit| <= {scale})");
        worst = worst.max(d / scale.max(1.0));
        for (ra, rb) in a.chunks(spec_vocab(&m)).zip(b.chunks(spec_vocab(&m))) {
            assert_eq!(argmax(ra).0, argmax(rb).0, "step {s}: greedy token differs with the normless router");
        }
    }
    for (s, (d, g)) in runs[1].iter().zip(&runs[2]).enumerate() {
        assert!(bits(d) == bits(g), "step {s}: normless router from graphs differs from direct launches (max |diff| {})", max_diff(d, g));
    }
    eprintln!("m2.7:iq4xs:2 fast path: normless router within {worst:.1e} (relative to the largest logit) of norm_q8 + router, greedy tokens identical, graphs bit-identical");
}

/// The gate/up that routes itself (`router_f32n` + `moe_gate_up_blkr`: the router's arrival and
/// top-k moved into the gate/up's blocks) at M2.7 dimensions (2 layers), with router blocks of 4
/// and 8 warps: one-token steps launch those instead of `router_topk_f32n` + `moe_gate_up_blk16`;
/// logits of steps of 1, 2 and 5 tokens bit-identical to routing in the router's last block,
/// direct and from graphs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_inline_route_is_bit_identical() {
    use minimax_rank::cuda::fast::{set_route_inline, set_router_f32n_warps};
    let mut m = synthetic("m2.7:iq4xs:2", 200, 23);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    // (inline, router warps a block)
    let set = |(inline, warps): (bool, u32)| {
        set_route_inline(Some(inline));
        set_router_f32n_warps(Some(warps));
    };
    let kernels = |m: &mut CudaModel, mode: (bool, u32), base: u32| -> Vec<String> {
        set(mode);
        one_token_step_kernels(m, 700 + base as u64, (base..base + 2).collect(), vec![3, 5, 7], 11)
    };
    let count = |ks: &[String], p: &str| ks.iter().filter(|k| k.starts_with(p)).count();
    let off = kernels(&mut m, (false, 4), 0);
    let inl = kernels(&mut m, (true, 4), 4);
    // The router's own gate/up: moe_gate_up_blk{16,32,8} (the stage shape is the plan's).
    let plain_gu = |ks: &[String]| ks.iter().filter(|k| k.starts_with("moe_gate_up_blk") && k.as_bytes().get(15).is_some_and(|c| c.is_ascii_digit())).count();
    assert!(count(&off, "router_topk_f32n") == 2 && plain_gu(&off) == 2 && count(&off, "moe_gate_up_blkr") == 0, "routing in the router: {off:?}");
    assert!(count(&inl, "router_f32n") == 2 && count(&inl, "moe_gate_up_blkr") == 2 && count(&inl, "router_topk_f32n") == 0, "inline routing: {inl:?}");
    let modes = [(false, 4), (true, 4), (true, 8), (false, 8)];
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, (mode, graphs)) in modes.iter().map(|&m| (m, false)).chain(modes.iter().map(|&m| (m, true))).enumerate() {
        set(mode);
        m.clear_graphs();
        m.set_fast(true, graphs);
        runs.push(fast_step_series(&mut m, 40 + 20 * i as u32));
    }
    set_route_inline(None);
    set_router_f32n_warps(None);
    m.clear_graphs();
    m.set_fast(true, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for b in 1..runs.len() {
        let what = format!("{:?}, graphs {}", modes[b % 4], b >= 4);
        for (s, (x, y)) in runs[0].iter().zip(runs[b].iter()).enumerate() {
            assert!(y.iter().all(|v| v.is_finite()), "{what}, step {s}: non-finite logits");
            assert!(bits(x) == bits(y), "{what}, step {s}: the logits differ from the router's last block, 4 warps, direct (max |diff| {})", max_diff(x, y));
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: inline routing and router blocks of 8 warps bit-identical to the router's last block over {} steps, direct and from graphs", runs[0].len());
}

/// The kernels of one direct (no graph) one-token step of sequence `seq` (token `next`) after
/// `prompt` filled its cache (pages `pt`), in launch order.
fn one_token_step_kernels(m: &mut CudaModel, seq: u64, pt: Vec<u32>, prompt: Vec<u32>, next: u32) -> Vec<String> {
    m.set_fast(true, false);
    let cached = prompt.len();
    m.forward(&ForwardBatch { seqs: vec![SeqStep { seq_id: seq, page_table: pt.clone(), cached_len: 0, tokens: prompt, logits: LogitsWanted::Last }] }).unwrap();
    m.gpu().profile_begin();
    m.forward(&ForwardBatch { seqs: vec![SeqStep { seq_id: seq, page_table: pt, cached_len: cached, tokens: vec![next], logits: LogitsWanted::Last }] }).unwrap();
    m.gpu().profile_end().unwrap().into_iter().map(|(n, _)| n).collect()
}

fn spec_vocab(m: &CudaModel) -> usize {
    m.config().vocab_size
}

/// The PDL variants (weights loaded before `griddepcontrol.wait`: `mvqs_*p`, `mvqs_*s2p`, `mvmma_q8_0p`,
/// `router_topk_f32p`, `qk_norm_rope_store_p_*`; `norm_q8e` / `attn_merge6e` triggering the
/// next launch before their wait) give logits bit-identical to the plain kernels at M2.7
/// dimensions (2 layers), directly and from the step graphs, for steps of 1, 2, 5 (tensor-core
/// q/k/v) and 8 tokens. A race (a dependent value read before the wait) would show as a
/// difference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_pdl_prefetch_is_bit_identical() {
    use minimax_rank::cuda::fast::{PDL_ALL_PARTS, PDL_EARLY_PARTS, PDL_MVQS2, PDL_PREFETCH_PARTS, PDL_ROUTER, set_pdl_parts};
    let mut m = synthetic("m2.7:iq4xs:2", 160, 11);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let all = PDL_ALL_PARTS;
    // (parts, graphs): the 2-rows-per-warp and the 1-row mvqs_*p both, early triggers alone.
    let settings = [(0, false), (all, false), (all, true), (PDL_PREFETCH_PARTS, true), ((PDL_PREFETCH_PARTS & !PDL_MVQS2) | PDL_ROUTER, true), (PDL_EARLY_PARTS, true), (0, true)];
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, (parts, graphs)) in settings.into_iter().enumerate() {
        set_pdl_parts(Some(parts));
        m.clear_graphs();
        m.set_fast(true, graphs);
        let out = fast_step_series(&mut m, 20 * i as u32);
        assert!(out.iter().all(|l| l.iter().all(|x| x.is_finite())), "parts {parts:#x} graphs {graphs}: non-finite logits");
        runs.push(out);
    }
    set_pdl_parts(None);
    m.set_fast(true, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, (parts, graphs)) in settings.iter().enumerate().skip(1) {
        for (s, (a, b)) in runs[0].iter().zip(&runs[i]).enumerate() {
            assert!(bits(a) == bits(b), "parts {parts:#x} graphs {graphs}, step {s}: logits differ from the plain kernels (max |diff| {})", max_diff(a, b));
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: PDL prefetch / early-trigger variants bit-identical to the plain kernels over {} steps x {} settings", runs[0].len(), settings.len() - 1);
}

/// The step series of the bit-identity tests: prompts of 5 + 3 tokens in one step, three more
/// sequences, then one-, two- and five-token decode steps, each sequence on its own 4 pages
/// from `base` (fresh pages per call). The logits of every step.
fn fast_step_series(m: &mut CudaModel, base: u32) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = vec![1, 17, 4242, 99_999, 200_000];
    let pts: Vec<Vec<u32>> = (0..5).map(|i| (base + 4 * i..base + 4 * i + 4).collect()).collect();
    let step = |seq: usize, cached: usize, tokens: Vec<u32>| SeqStep { seq_id: seq as u64, page_table: pts[seq].clone(), cached_len: cached, tokens, logits: LogitsWanted::Last };
    let mut out = Vec::new();
    let o = m.forward(&ForwardBatch { seqs: vec![step(0, 0, prompt.clone()), step(1, 0, prompt[..3].to_vec())] }).unwrap();
    out.push(o.logits.clone());
    let mut tok = vec![argmax(o.row(0)).0, argmax(o.row(1)).0, 0, 0, 0];
    let mut cached = vec![5usize, 3, 0, 0, 0];
    let o = m.forward(&ForwardBatch { seqs: (2..5).map(|i| step(i, 0, prompt[..i].to_vec())).collect() }).unwrap();
    out.push(o.logits.clone());
    for i in 2..5 {
        tok[i] = argmax(o.row(i - 2)).0;
        cached[i] = i;
    }
    for nseq in [1usize, 1, 2, 5, 1, 5, 1] {
        let o = m.forward(&ForwardBatch { seqs: (0..nseq).map(|i| step(i, cached[i], vec![tok[i]])).collect() }).unwrap();
        for i in 0..nseq {
            tok[i] = argmax(o.row(i)).0;
            cached[i] += 1;
        }
        out.push(o.logits.clone());
    }
    out
}

/// The RMSNorms folded into the router (`router_topk_norm_f32`) and into the streamed down's last
/// block (the next layer's attention norm, the output norm after the last layer), with either
/// trigger point, direct and from graphs: logits bit-identical to the separate `norm_q8`
/// launches at every step size (the down's fusion runs at one token).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_norm_fusion_is_bit_identical() {
    use minimax_rank::cuda::fast::{set_norm_fusion, set_norm_x8, set_router_normless};
    // The separate MoE norm is the baseline (router_topk_f32n rounds differently), and the
    // down's last-block norm the fused form (the x8 hand-over rounds differently: its own test).
    set_router_normless(Some(false));
    set_norm_x8(Some(false));
    let mut m = synthetic("m2.7:iq4xs:2", 200, 12);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    // (router, down, late trigger, graphs)
    let settings = [(false, false, true, false), (true, false, true, false), (false, true, true, false), (true, true, true, true), (true, true, false, true), (false, false, true, true)];
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    for (i, &(router, down, late, graphs)) in settings.iter().enumerate() {
        set_norm_fusion(Some(router), Some(down), Some(late));
        m.clear_graphs();
        m.set_fast(true, graphs);
        let out = fast_step_series(&mut m, 20 * i as u32);
        assert!(out.iter().all(|l| l.iter().all(|x| x.is_finite())), "{:?}: non-finite logits", settings[i]);
        runs.push(out);
    }
    set_norm_fusion(None, None, None);
    set_router_normless(None);
    set_norm_x8(None);
    m.clear_graphs();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, st) in settings.iter().enumerate().skip(1) {
        for (s, (a, b)) in runs[0].iter().zip(&runs[i]).enumerate() {
            assert!(bits(a) == bits(b), "{st:?} (router, down, late, graphs), step {s}: logits differ from separate norms (max |diff| {})", max_diff(a, b));
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: fused norms bit-identical to separate norm_q8 launches over {} steps x {} settings", runs[0].len(), settings.len() - 1);
}

/// The attention norm handed over in groups of 8 by the streamed down (`fast::set_norm_x8`:
/// `dn_x8`, then `mvqs_q8_0_1s2p8` takes the norm's 1 / rms) at M2.7 dimensions (2 layers): a
/// one-token step launches the x8 product once (layer 1; layer 0's norm is `norm_q8`) and the
/// last-block form none; over the bit-identity series the prompt steps are bit-identical (x8 is
/// one-token only), the first one-token step differs (the finer q8 scales) and every later step
/// is within 1e-2 of the largest |logit|, directly and from graphs, until one changes its argmax
/// (the first two one-token steps must not).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_norm_x8_matches_last_block_norm() {
    use minimax_rank::cuda::fast::set_norm_x8;
    let mut m = synthetic("m2.7:iq4xs:2", 200, 31);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let count = |ks: &[String], p: &str| ks.iter().filter(|k| k.starts_with(p)).count();
    set_norm_x8(Some(true));
    let on = one_token_step_kernels(&mut m, 900, vec![100, 101], vec![3, 5, 7], 11);
    set_norm_x8(Some(false));
    let off = one_token_step_kernels(&mut m, 901, vec![102, 103], vec![3, 5, 7], 11);
    assert!(count(&on, "mvqs_q8_0_1s2p8") == 1 && count(&on, "norm_q8") == 1, "x8: {on:?}");
    assert!(count(&off, "mvqs_q8_0_1s2p8") == 0, "last-block norm: {off:?}");
    let mut runs = Vec::new();
    for (i, (x8, graphs)) in [(false, false), (true, false), (true, true)].into_iter().enumerate() {
        set_norm_x8(Some(x8));
        m.clear_graphs();
        m.set_fast(true, graphs);
        runs.push(fast_step_series(&mut m, 20 * i as u32));
    }
    set_norm_x8(None);
    m.clear_graphs();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // The series' steps: two prompt steps (before any one-token step: bit-identical), then
    // decode steps of 1, 1, 2, 5, 1, 5, 1 sequences, which read the keys the one-token steps
    // stored. Compared until a step changes its argmax (the next inputs then differ).
    let mut worst = 0f32;
    for r in 1..3 {
        for (s, (a, b)) in runs[0].iter().zip(&runs[r]).enumerate() {
            assert!(b.iter().all(|x| x.is_finite()), "run {r} step {s}: non-finite logits");
            if s < 2 {
                assert!(bits(a) == bits(b), "run {r} step {s} (prompts): logits differ (max |diff| {})", max_diff(a, b));
                continue;
            }
            let top = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = max_diff(a, b);
            assert!(d <= 1e-2 * top, "run {r} step {s}: max |diff| {d} (largest |logit| {top}; within 1e-2)");
            assert!(s != 2 || d > 0.0, "run {r}: the first one-token step is bit-identical: x8 did not run");
            worst = worst.max(d / top);
            if argmax(a).0 != argmax(b).0 {
                assert!(s >= 4, "run {r} step {s}: argmax changed");
                break;
            }
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: x8 attention-norm hand-over within {worst:.2e} of the largest |logit| of the last-block norm on one-token steps, bit-identical elsewhere, direct and from graphs");
}

/// The q/k norm launch left out of one-token steps (`fast::set_qk_fuse`: `attn_dec6tn_*` sums
/// the squares of the raw q / k rows, normalizes, rotates and stores them with the step's
/// `rope_table`) at
/// M2.7 dimensions (2 layers): one-token steps launch those and no `qk_norm_rope_store`; logits
/// bit-identical to the two-launch path (its summation order is played) over the bit-identity
/// series (steps of 1, 2 and 5 tokens: the multi-token ones keep the q/k norm launch) and over
/// three decode steps after prompts of 600 and 2,100 tokens (the new position in later splits
/// and tiles; the keys it stores are read back by the next steps), directly, from graphs, with
/// the first K/V tiles after the PDL wait, with the merge's early trigger off, and with and
/// without the blocks of empty splits leaving before their wait.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_path_qk_fuse_matches_qk_norm_launch() {
    use minimax_rank::cuda::fast::set_qk_fuse;
    let mut m = synthetic("m2.7:iq4xs:2", 2200, 23);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let kernels = |m: &mut CudaModel, on: bool, base: u32| -> Vec<String> {
        set_qk_fuse(Some(on));
        one_token_step_kernels(m, 700 + base as u64, (base..base + 2).collect(), vec![3, 5, 7], 11)
    };
    let count = |ks: &[String], p: &str| ks.iter().filter(|k| k.starts_with(p)).count();
    let on = kernels(&mut m, true, 0);
    let off = kernels(&mut m, false, 4);
    assert!(count(&on, "attn_dec6tn") == 2 && count(&on, "qk_norm_rope_store") == 0 && count(&on, "rope_table") == 1, "fused: {on:?}");
    assert!(count(&off, "qk_norm_rope_store") == 2 && count(&off, "attn_dec6tn") == 0, "two launches: {off:?}");
    // Decode after long prompts: each sequence on its own pages from `base`.
    let long_steps = |m: &mut CudaModel, base: u32| -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        let mut b = base;
        for (i, ctx) in [600usize, 2100].into_iter().enumerate() {
            let pt: Vec<u32> = (b..b + (ctx + 4).div_ceil(PAGE) as u32).collect();
            b += pt.len() as u32;
            let seq = 5000 + base as u64 + i as u64;
            let prompt: Vec<u32> = (0..ctx as u32).map(|j| (j * 7919 + 11) % 200_000).collect();
            let o = m.forward(&ForwardBatch { seqs: vec![SeqStep { seq_id: seq, page_table: pt.clone(), cached_len: 0, tokens: prompt, logits: LogitsWanted::Last }] }).unwrap();
            let mut tok = argmax(o.row(0)).0;
            for s in 0..3 {
                let o = m.forward(&ForwardBatch { seqs: vec![SeqStep { seq_id: seq, page_table: pt.clone(), cached_len: ctx + s, tokens: vec![tok], logits: LogitsWanted::Last }] }).unwrap();
                tok = argmax(o.row(0)).0;
                out.push(o.logits.clone());
            }
        }
        out
    };
    let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
    // (fused, graphs, first K/V tiles before the wait, merge triggering the o-projection early,
    // blocks of empty splits leaving before their wait)
    let settings = [
        (false, false, true, true, false),
        (true, false, true, true, false),
        (true, true, true, true, false),
        (true, false, false, true, false),
        (true, true, true, false, false),
        (true, false, true, true, true),
        (true, true, true, true, true),
    ];
    for (i, (on, graphs, pre, early, exit)) in settings.into_iter().enumerate() {
        set_qk_fuse(Some(on));
        minimax_rank::cuda::fast::set_qk_pre_tiles(Some(pre));
        minimax_rank::cuda::fast::set_qk_merge_early(Some(early));
        minimax_rank::cuda::fast::set_attn_exit_empty(Some(exit));
        m.clear_graphs();
        m.set_fast(true, graphs);
        let mut r = fast_step_series(&mut m, 40 + 20 * i as u32);
        r.extend(long_steps(&mut m, 200 + 300 * i as u32));
        runs.push(r);
    }
    set_qk_fuse(None);
    minimax_rank::cuda::fast::set_qk_pre_tiles(None);
    minimax_rank::cuda::fast::set_qk_merge_early(None);
    minimax_rank::cuda::fast::set_attn_exit_empty(None);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (v, (on, graphs, pre, early, exit)) in settings.iter().enumerate().skip(1) {
        for (s, (a, b)) in runs[0].iter().zip(&runs[v]).enumerate() {
            assert!(bits(a) == bits(b), "fused {on} graphs {graphs} first tiles before the wait {pre} early merge {early} empty splits leave {exit}, step {s}: logits differ from the q/k norm launch (max |diff| {})", max_diff(a, b));
        }
    }
    eprintln!("m2.7:iq4xs:2 fast path: q/k norms in the attention bit-identical to the q/k norm launch over {} steps (direct, graphs, first tiles after the wait, merge without the early trigger, blocks of empty splits leaving at once)", runs[0].len());
}

/// Overlapped decode's device-fed tokens (`CudaModel::set_device_feed`): a step whose tokens are
/// the greedy draws the previous step's sampling merge left on the device, launched before that
/// reduction is read back, gives bit for bit the logits of the same step fed those tokens from
/// the host; the rows are fed in another order than they were drawn (batch index != pick
/// index), and the earlier step's reduction, read back after the next step ran, is intact
/// (its logits buffer alternates with the next step's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_fed_tokens_give_the_logits_of_host_fed_tokens() {
    use minimax_shared::sampling::SamplingSpec;
    let mut m = synthetic("m2.7:iq4xs:2", 64, 7);
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let prompts: [Vec<u32>; 3] = [vec![1, 17, 4242, 99_999, 200_000], vec![5, 6, 7, 8], vec![123_456, 42, 7]];
    let greedy = SamplingSpec { temperature: 0.0, ..Default::default() };
    let jobs: Vec<(SamplingSpec, Option<u32>)> = (0..3).map(|_| (greedy.clone(), None)).collect();
    let step = |seq: u64, pt: &[u32], cached: usize, tokens: Vec<u32>| SeqStep { seq_id: seq, page_table: pt.to_vec(), cached_len: cached, tokens, logits: LogitsWanted::Last };
    // The second step feeds row order [2, 0, 1] of the first.
    let order = [2usize, 0, 1];
    let mut results = Vec::new();
    for (path, device) in [(0u32, false), (1, true)] {
        let pts: Vec<Vec<u32>> = (0..3u32).map(|s| vec![10 * (3 * path + s)]).collect();
        let seq = |s: usize| 100 * path as u64 + s as u64;
        let a = ForwardBatch { seqs: (0..3).map(|s| step(seq(s), &pts[s], 0, prompts[s].clone())).collect() };
        let pending = m.forward_stage_lazy(&a).unwrap().unwrap().enqueue_reduce(&jobs, &[None; 3]).unwrap().expect("rows on the device");
        let picks: Vec<usize> = (0..3).map(|r| pending.pick_index(r).expect("a device pick")).collect();
        let (logits_b, drawn) = if device {
            // Launched before the first step is read back; the tokens are placeholders.
            m.set_device_feed(order.iter().enumerate().map(|(bi, &r)| (bi, picks[r])).collect());
            let b = ForwardBatch { seqs: order.iter().map(|&s| step(seq(s), &pts[s], prompts[s].len(), vec![0])).collect() };
            let lb = m.forward_stage(&b).unwrap().unwrap().logits;
            let c = m.collect_reduce(pending, &jobs).unwrap();
            (lb, c)
        } else {
            let c = m.collect_reduce(pending, &jobs).unwrap();
            let b = ForwardBatch { seqs: order.iter().map(|&s| step(seq(s), &pts[s], prompts[s].len(), vec![c.results[s].as_ref().unwrap().candidate_ids[0]])).collect() };
            (m.forward_stage(&b).unwrap().unwrap().logits, c)
        };
        let tokens: Vec<u32> = drawn.results.iter().map(|r| r.as_ref().unwrap().candidate_ids[0]).collect();
        let picked: Vec<u32> = drawn.picks.iter().map(|p| p.expect("a pick read back")).collect();
        assert_eq!(tokens, picked, "path {path}: the device picks are the greedy draws");
        assert!(logits_b.iter().all(|x| x.is_finite()));
        results.push((tokens, logits_b));
    }
    assert_eq!(results[0].0, results[1].0, "the first step's draws differ");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&results[0].1) == bits(&results[1].1), "device-fed logits differ from host-fed (max |diff| {})", max_diff(&results[0].1, &results[1].1));
    // A wrong feed would show: the fed tokens differ between rows, and so do the rows' logits.
    let v = m.config().vocab_size;
    assert!(results[0].1[..v] != results[0].1[v..2 * v], "two rows with the same logits");
    eprintln!("device-fed tokens {:?} (rows fed in order {order:?}): logits bit-identical to host-fed", results[0].0);
}
