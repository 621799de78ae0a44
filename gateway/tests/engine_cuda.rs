//! The engine against a REAL CUDA rank (`minimax-rank serve --device cuda:0`) serving eight
//! synthetic MiniMax-M2.7 layers (the real widths, so decode takes the fast path: graphs,
//! device sampling, and overlapped decode with device-fed tokens, where step N+1 is launched
//! before step N is read back and embeds N's draw from the device). Ignored without a
//! GPU; run on one with prebuilt binaries (`MINIMAX_RANK_BINARY`, `--ignored`).
//!
//! What must hold: the tokens are those of one step at a time (overlap off), for requests one
//! by one (greedy, greedy with a repetition penalty, seeded sampling with penalties, seeded
//! sampling with MiniMax's defaults and with min_p, which the merge kernel draws and feeds on
//! the device, a stop token, structured outputs greedy and sampled, each a whole document of
//! its schema), and the same with device feeding off (`MINIMAX_DEVICE_FEED=0`, overlap on); a
//! structured output beside a plain request gives a whole document; four greedy requests at
//! once (device-fed rows 0-3) complete; and the rank's log (its stderr, appended to a file by a
//! wrapper script) shows a step fed from the device, one fed a sampled token drawn there, and a structured
//! output's forward launched before its rule arrived (late rules: the default,
//! `MINIMAX_LATE_FORWARD=0` set in the runs without feeding), exactly in the run with device
//! feeding on.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{greedy_req, prompt, stop, tokens_and_end};
use minimax_gateway::engine::{Engine, EngineConfig, FinishReason, GenerationRequest, SamplingParams};
use minimax_gateway::ranks::supervisor::WorldMode;
use minimax_gateway::sched::SchedConfig;

/// The rank's log (its stderr): the rank runs through a wrapper script that appends it here.
fn rank_log(dir: &std::path::Path) -> PathBuf {
    dir.join("rank.log")
}

fn config(overlap: bool, device_feed: bool) -> (EngineConfig, PathBuf) {
    let (mut w, dir) = common::spawn_world("mmx-cuda", 1, "tensor", 64, vec![]);
    if let WorldMode::Spawn(s) = &mut w.mode {
        s.devices = vec![std::env::var("MINIMAX_TEST_CUDA_DEVICE").unwrap_or_else(|_| "cuda:0".into())];
        s.synthetic = Some("m2.7:iq4xs:8".into());
        s.env.push(("MINIMAX_DEVICE_FEED".into(), if device_feed { "1" } else { "0" }.into()));
        // Sampled rows drawn on the device too (the default; off with feeding off, so the log check
        // below tells the two apart).
        s.env.push(("MINIMAX_DEVICE_DRAW".into(), if device_feed { "1" } else { "0" }.into()));
        // Structured outputs' forward before their rules arrive (late rules), with feeding on.
        s.env.push(("MINIMAX_LATE_FORWARD".into(), if device_feed { "1" } else { "0" }.into()));
        s.env.push(("RUST_LOG".into(), "info".into()));
        std::fs::create_dir_all(&dir).unwrap();
        let wrapper = dir.join("rank.sh");
        let script = format!("#!/bin/sh\nexec '{}' \"$@\" 2>>'{}'\n", s.rank_binary.display(), rank_log(&dir).display());
        std::fs::write(&wrapper, script).unwrap();
        std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        s.rank_binary = wrapper;
    }
    w.load_timeout = Duration::from_secs(600);
    w.step_timeout = Duration::from_secs(30);
    let mut sched = SchedConfig { prefill_chunk: 24, ..Default::default() };
    sched.overlap = overlap;
    (EngineConfig { sched, world: w }, dir)
}

/// The end-of-generation token of [`json_spec`]'s vocabulary.
const EOG: u32 = 96;

/// A JSON schema over 97 tokens of the model's vocabulary (token t < 95 is the byte 0x20 + t,
/// 96 ends generation; the others never fit), so a mask is a small allowed set (sent as bits).
fn json_spec() -> std::sync::Arc<minimax_gateway::constrain::ConstraintSpec> {
    use minimax_gateway::constrain::schema::Grammar;
    use minimax_gateway::constrain::vocab::TokenIndex;
    use minimax_gateway::constrain::{ConstraintSpec, Mode};
    let items = (0..95u32).map(|t| (t, vec![0x20 + t as u8])).collect();
    let index = std::sync::Arc::new(TokenIndex::from_tokens(200_064, items, vec![EOG]));
    let schema = serde_json::json!({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["id", "n"], "additionalProperties": false});
    std::sync::Arc::new(ConstraintSpec { grammar: Grammar::from_schema(&schema).unwrap(), index, reasoning: None, starts_in_reasoning: false, mode: Mode::Document })
}

/// A structured-output request of [`json_spec`] with a bias against the space token.
fn json_req(id: &str, salt: u32, sampling: SamplingParams) -> GenerationRequest {
    let sampling = SamplingParams { constraint: Some(json_spec()), logit_bias: [(0u32, -30.0f32)].into_iter().collect(), ..sampling };
    GenerationRequest { request_id: id.into(), prompt: prompt(25, salt), max_tokens: 48, sampling, stop_token_ids: vec![EOG] }
}

/// The output is a whole document of [`json_spec`]'s schema that ended on its stop token.
fn check_json(out: &(Vec<u32>, Option<FinishReason>), what: &str) {
    let (toks, finish) = out;
    let text: String = toks.iter().map(|&t| char::from(0x20 + t as u8)).collect();
    eprintln!("structured output, {what} ({finish:?}): {text}");
    assert!(toks.iter().all(|&t| t < 95), "{what}: {toks:?}");
    assert_eq!(*finish, Some(FinishReason::Stop), "{what}: the document did not end: {text}");
    let doc: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{what}: {e}: {text}"));
    assert!(doc["n"].as_u64().is_some_and(|n| n <= 999) && doc["id"].as_str().is_some_and(|s| (2..=5).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase())), "{what}: {text}");
}

async fn run(engine: &Engine, req: GenerationRequest) -> (Vec<u32>, Option<FinishReason>) {
    let stream = engine.generate(req).expect("accepted");
    let events = tokio::time::timeout(Duration::from_secs(300), stream.collect_all()).await.expect("generation finished in time");
    let (tokens, finish) = tokens_and_end(events);
    (tokens, Some(finish.expect("the request succeeded").0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn cuda_overlapped_decode_with_device_fed_tokens_gives_the_tokens_of_one_step_at_a_time() {
    let penalized = |seed: Option<u64>, temperature: f32| SamplingParams { temperature, top_k: 30, seed, frequency_penalty: 0.6, presence_penalty: 0.3, repetition_penalty: 1.2, ..Default::default() };
    let mut runs = vec![];
    let mut stop_at = vec![];
    for (overlap, feed) in [(false, false), (true, true), (true, false)] {
        let (cfg, dir) = config(overlap, feed);
        let engine = Engine::start(cfg);
        engine.wait_ready(Duration::from_secs(600)).await.expect("rank ready");
        let mut all = vec![];
        // One by one: every step has one token.
        let probe = run(&engine, greedy_req("probe", prompt(30, 5), 40)).await;
        // A stop token: the first output token not seen before it, from the fourth on if any
        // (random weights repeat tokens).
        eprintln!("overlap {overlap}, device feed {feed}: probe {:?}", probe.0);
        let at = (3..probe.0.len()).chain(1..3).find(|&k| !probe.0[..k].contains(&probe.0[k])).unwrap_or(0);
        let mut with_stop = greedy_req("stop", prompt(30, 5), 40);
        with_stop.stop_token_ids = vec![probe.0[at]];
        stop_at.push(at);
        all.push(probe);
        all.push(run(&engine, with_stop).await);
        all.push(run(&engine, GenerationRequest { request_id: "rep".into(), prompt: prompt(17, 6), max_tokens: 24, sampling: penalized(None, 0.0), stop_token_ids: vec![] }).await);
        all.push(run(&engine, GenerationRequest { request_id: "s1".into(), prompt: prompt(45, 7), max_tokens: 24, sampling: penalized(Some(11), 0.8), stop_token_ids: vec![] }).await);
        // MiniMax's recommended sampling (the defaults: temperature 1, top_p 0.95, top_k 40),
        // seeded, no penalties: drawn on the device by the merge kernel and fed from there
        // when device feeding is on; and with min_p and a lower temperature.
        all.push(run(&engine, GenerationRequest { request_id: "s2".into(), prompt: prompt(38, 9), max_tokens: 32, sampling: SamplingParams { seed: Some(7), ..Default::default() }, stop_token_ids: vec![] }).await);
        let sp = SamplingParams { seed: Some(8), temperature: 0.6, min_p: 0.05, ..Default::default() };
        all.push(run(&engine, GenerationRequest { request_id: "s3".into(), prompt: prompt(21, 10), max_tokens: 32, sampling: sp, stop_token_ids: vec![] }).await);
        // Structured outputs (an ASCII vocabulary inside the model's: token t < 95 is the byte
        // 0x20 + t), greedy and with MiniMax's sampling: with overlap their next step goes out
        // before the token is known and the rule follows (late rules); the forward runs
        // meanwhile and the reduction, masked, waits for it.
        // A bias against the space token keeps random weights from spending every step on
        // whitespace (one mask again and again), so each step's mask differs from the last and
        // a rule applied to the wrong step would show.
        for (id, sampling) in [("json-greedy", SamplingParams { temperature: 0.0, ..Default::default() }), ("json-sampled", SamplingParams { seed: Some(5), ..Default::default() })] {
            all.push(run(&engine, json_req(id, 11, sampling)).await);
        }
        // (Late rules only where the rank takes them: MINIMAX_LATE_FORWARD=0 in the runs without feeding.)
        let rules = engine.metrics().late_rules;
        assert_eq!(rules > 0, overlap && feed, "overlap {overlap}, device feed {feed}: late rules sent: {rules}");
        // A structured output beside a plain one (two-token steps: one row masked, its rule
        // following, the other not): the document is valid, the plain one completes.
        let pair = futures_util::future::join_all([json_req("json-pair", 12, SamplingParams { temperature: 0.0, ..Default::default() }), greedy_req("plain-pair", prompt(19, 13), 32)].map(|r| run(&engine, r))).await;
        check_json(&pair[0], &format!("overlap {overlap}, device feed {feed}, beside a plain request"));
        assert_eq!((pair[1].0.len(), pair[1].1), (32, Some(FinishReason::Length)));
        // Four greedy requests at once (steps of up to four tokens, device-fed rows 0-3).
        let reqs: Vec<GenerationRequest> = (0..4).map(|i| greedy_req(&format!("g{i}"), prompt(9 + 5 * i as usize, 8 + i), 32)).collect();
        let outs = futures_util::future::join_all(reqs.into_iter().map(|r| run(&engine, r))).await;
        for o in &outs {
            eprintln!("overlap {overlap}, device feed {feed}: concurrent {:?}", o.0);
        }
        // The outputs depend on the input (so a wrong fed token would show).
        assert!(outs.iter().any(|o| o.0 != outs[0].0), "four prompts, one output: the model ignores its input");
        // Steps of several tokens run other kernels than one-token steps (other summation
        // orders), and which sequences share a step depends on timing: these outputs are not
        // compared across runs, only required to complete (a device-fed token that was not the
        // drawn one fails its request; the model test `device_fed_tokens_give_the_logits_of_
        // host_fed_tokens` checks batched feeding bit for bit).
        for o in &outs {
            assert_eq!((o.0.len(), o.1), (32, Some(FinishReason::Length)));
        }
        let m = engine.metrics();
        assert_eq!(m.steps_in_flight_max, if overlap { 2 } else { 1 }, "overlap {overlap}: {m:?}");
        runs.push(all);
        // Whether a step was launched before the one it follows was read back (the rank logs
        // the first such step): it must happen with device feeding on, and never with it off.
        let log = std::fs::read_to_string(rank_log(&dir)).unwrap_or_default();
        assert_eq!(log.contains("device-fed tokens"), overlap && feed, "overlap {overlap}, device feed {feed}: device feeding seen in the rank's log");
        assert_eq!(log.contains("device-drawn tokens"), overlap && feed, "overlap {overlap}, device feed {feed}: a sampled token fed from the device seen in the rank's log");
        assert_eq!(log.contains("forward first"), overlap && feed, "overlap {overlap}, device feed {feed}: a structured output's forward launched before its rule, seen in the rank's log");
        stop(engine, dir).await;
    }
    let stop_run = &runs[0][1];
    assert_eq!(stop_run.1, Some(FinishReason::Stop));
    assert_eq!(stop_run.0.len(), stop_at[0], "the stop token ends the output before it");
    assert_eq!(runs[0][0].0.len(), 40);
    // The structured outputs are whole documents of the schema.
    for out in &runs[0][6..8] {
        check_json(out, "one step at a time");
    }
    for r in 1..runs.len() {
        for (i, (a, b)) in runs[0].iter().zip(&runs[r]).enumerate() {
            assert_eq!(a, b, "run {r} (overlap / device feed), request {i}: the output differs from one step at a time");
        }
    }
}
