//! Late rules (one-rank worlds): a structured output's row whose rule (logit bias, allowed
//! tokens) depends on the token the step before draws is sent with `SamplingSpec.rule_follows`,
//! so its forward can run while the gateway learns that token; the rule arrives in a later
//! `StepRequest.late_rules`, which every step handler deposits here first, and the row's
//! reduction waits for it.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use minimax_proto::v1 as pb;

use super::StepError;

/// Rules remembered for steps this far behind the newest one seen, at most (a rule for a step
/// that never reached this rank, or whose rows were refused, is dropped after that).
const KEPT_STEPS: u64 = 1024;

/// The rules that arrived and were not taken yet, keyed by (step, sequence).
#[derive(Default)]
pub(super) struct LateRules {
    st: Mutex<Kept>,
    cv: Condvar,
}

#[derive(Default)]
struct Kept {
    rules: HashMap<(u64, u64), pb::LateRule>,
    newest: u64,
}

impl LateRules {
    /// Takes in the rules a request carries and wakes the rows waiting for them.
    pub(super) fn deposit(&self, rules: &[pb::LateRule]) {
        if rules.is_empty() {
            return;
        }
        let mut st = self.st.lock().unwrap();
        for r in rules {
            st.newest = st.newest.max(r.step_id);
            st.rules.insert((r.step_id, r.seq_id), r.clone());
        }
        let newest = st.newest;
        st.rules.retain(|&(step, _), _| step + KEPT_STEPS > newest);
        self.cv.notify_all();
    }

    /// Forgets every rule (a new world).
    pub(super) fn clear(&self) {
        let mut st = self.st.lock().unwrap();
        *st = Kept::default();
        self.cv.notify_all();
    }

    /// Waits (at most `timeout`, and while `ready`) for the rules of `seq_ids`' rows in step
    /// `step_id`, and takes them, in the order asked.
    pub(super) fn wait(&self, step_id: u64, seq_ids: &[u64], timeout: Duration, ready: &dyn Fn() -> bool) -> Result<Vec<pb::LateRule>, StepError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.st.lock().unwrap();
        loop {
            if seq_ids.iter().all(|&s| st.rules.contains_key(&(step_id, s))) {
                return Ok(seq_ids.iter().map(|&s| st.rules.remove(&(step_id, s)).expect("checked above")).collect());
            }
            if !ready() {
                return Err(StepError::Comm(crate::comm::CommError { op: "step", detail: "the rank stopped serving while a row waited for its rule".into() }));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<u64> = seq_ids.iter().copied().filter(|&s| !st.rules.contains_key(&(step_id, s))).collect();
                return Err(StepError::Invalid(format!("step {step_id}: the rules of sequences {missing:?} (sent with rule_follows) never arrived within {timeout:?}")));
            }
            st = self.cv.wait_timeout(st, left.min(Duration::from_millis(100))).unwrap().0;
        }
    }
}

/// Whether a CUDA rank runs a step's forward before its rows' rules are in (the point of late
/// rules: the forward overlaps the gateway's turn), as a CPU rank always does. On by default
/// (measured on an H100 in session 34); `MINIMAX_LATE_FORWARD=0` turns it off for an A/B, and
/// the rank then tells the gateway (`DescribeResponse.late_forward`), which sends it no late
/// rows.
pub(super) fn forward_first() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MINIMAX_LATE_FORWARD").map_or(true, |v| v != "0"))
}

/// Whether a rank runs a step's forward before its late rows' rules arrive (what it reports as
/// `DescribeResponse.late_forward`): a CPU rank always, a CUDA rank with [`forward_first`].
pub(super) fn late_forward(cuda: bool) -> bool {
    !cuda || forward_first()
}

/// The sequences of `req`'s agreed rows (`batch_src`: their request indices) whose rule
/// follows.
pub(super) fn rows_waiting(req: &pb::StepRequest, batch_src: &[usize]) -> Vec<u64> {
    batch_src.iter().map(|&i| &req.seqs[i]).filter(|s| s.sampling.as_ref().is_some_and(|sp| sp.rule_follows)).map(|s| s.seq_id).collect()
}

/// Puts each rule into its row's spec (the fields it replaces), so the reduction sees the
/// row as if the rule had come with it.
pub(super) fn apply(req: &mut pb::StepRequest, rules: Vec<pb::LateRule>) {
    for r in rules {
        if let Some(sp) = req.seqs.iter_mut().find(|s| s.seq_id == r.seq_id).and_then(|s| s.sampling.as_mut()) {
            pb::apply_late_rule(sp, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(step_id: u64, seq_id: u64, token: u32) -> pb::LateRule {
        pb::LateRule { step_id, seq_id, logit_bias: vec![pb::TokenBias { token, bias: f32::NEG_INFINITY }], allowed_tokens: None }
    }

    /// A waiting row gets its rule when another thread deposits it, the others' rules stay,
    /// and a rule that never comes ends the wait with an error naming the sequence.
    #[test]
    fn rows_wait_for_their_rules_and_give_up_after_the_timeout() {
        let rules = std::sync::Arc::new(LateRules::default());
        let r2 = rules.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            r2.deposit(&[rule(7, 1, 3), rule(7, 2, 4), rule(8, 1, 5)]);
        });
        let got = rules.wait(7, &[2, 1], Duration::from_secs(10), &|| true).unwrap();
        t.join().unwrap();
        assert_eq!(got.iter().map(|r| (r.seq_id, r.logit_bias[0].token)).collect::<Vec<_>>(), vec![(2, 4), (1, 3)]);
        // Taken: waiting again for step 7 times out; step 8's rule is still there.
        let err = rules.wait(7, &[1], Duration::from_millis(20), &|| true).unwrap_err();
        assert!(err.to_string().contains("[1]") && err.to_string().contains("never arrived"), "{err}");
        assert_eq!(rules.wait(8, &[1], Duration::ZERO, &|| true).unwrap()[0].logit_bias[0].token, 5);
        // A rank that stops serving ends the wait at once.
        assert!(matches!(rules.wait(9, &[1], Duration::from_secs(10), &|| false), Err(StepError::Comm(_))));
    }

    /// Old rules are dropped once the steps move far past them.
    #[test]
    fn rules_of_old_steps_are_dropped() {
        let rules = LateRules::default();
        rules.deposit(&[rule(1, 1, 0)]);
        rules.deposit(&[rule(1 + KEPT_STEPS, 1, 0)]);
        assert!(rules.wait(1, &[1], Duration::ZERO, &|| true).is_err());
        assert!(rules.wait(1 + KEPT_STEPS, &[1], Duration::ZERO, &|| true).is_ok());
    }

    /// A rule replaces the row's bias and mask and clears the flag; other rows are untouched.
    #[test]
    fn a_rule_lands_in_its_row() {
        let sp = |follows: bool| Some(pb::SamplingSpec { rule_follows: follows, logit_bias: vec![pb::TokenBias { token: 9, bias: 1.0 }], ..Default::default() });
        let mut req = pb::StepRequest { step_id: 3, seqs: vec![pb::SeqStep { seq_id: 1, sampling: sp(true), ..Default::default() }, pb::SeqStep { seq_id: 2, sampling: sp(false), ..Default::default() }], ..Default::default() };
        assert_eq!(rows_waiting(&req, &[0, 1]), vec![1]);
        assert!(rows_waiting(&req, &[1]).is_empty());
        apply(&mut req, vec![pb::LateRule { allowed_tokens: Some(vec![0b101]), ..rule(3, 1, 4) }]);
        let a = req.seqs[0].sampling.as_ref().unwrap();
        assert_eq!((a.rule_follows, a.logit_bias[0].token, a.allowed_tokens.as_deref()), (false, 4, Some(&[0b101u8][..])));
        assert_eq!(req.seqs[1].sampling.as_ref().unwrap().logit_bias[0].token, 9);
    }
}
