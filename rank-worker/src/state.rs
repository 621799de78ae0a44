//! The rank's side of the KV-length handshake: what it believes each sequence's cache length
//! is, the per-sequence check against the gateway's `expected_cache_len`, the agreement record
//! every rank shares before computing, and the hidden test fault hook.

use std::collections::HashMap;

/// Why this rank cannot run a sequence of the step (its local verdict).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// The gateway's expected length differs from this rank's.
    LengthMismatch { actual: u32 },
    /// The sequence's part of the batch is invalid here (pages, tokens, length).
    Invalid(String),
}

impl Verdict {
    fn code(&self) -> u8 {
        match self {
            Verdict::Ok => 0,
            Verdict::LengthMismatch { .. } => 1,
            Verdict::Invalid(_) => 2,
        }
    }
}

/// A test-only fault that makes this rank mis-track a cache length (see `docs/RANK.md`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TestFault {
    /// After every executed step of this sequence, record one position too many.
    WrongCacheLen { seq_id: u64 },
    /// After `n` executed steps, record one position too many for the first sequence of the
    /// next step (once).
    WrongCacheLenAfterSteps { n: u64 },
}

impl std::str::FromStr for TestFault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, arg) = s.split_once(':').ok_or_else(|| format!("test fault '{s}': expected KIND:ARG"))?;
        let n: u64 = arg.parse().map_err(|e| format!("test fault '{s}': {e}"))?;
        match kind {
            "wrong-cache-len" => Ok(TestFault::WrongCacheLen { seq_id: n }),
            "wrong-cache-len-after-steps" => Ok(TestFault::WrongCacheLenAfterSteps { n }),
            _ => Err(format!("unknown test fault '{kind}' (wrong-cache-len:SEQ_ID, wrong-cache-len-after-steps:N)")),
        }
    }
}

/// The draw a `feed_drawn` step feeds, as this rank knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draw {
    /// Drawn and checked on the host.
    Token(u32),
    /// The step with compute ticket `ticket` draws it and was launched without being read back
    /// yet; `pick`: where it leaves the draw on the device, when that is the token (a row the
    /// device draws as the host does, whose next step's sampling does not depend on it).
    Pending { ticket: u64, pick: Option<usize> },
}

/// How a `feed_drawn` sequence gets its token ([`SeqTable::feed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feed {
    /// The token, known on the host.
    Token(u32),
    /// The device pick `pick` of the step with compute ticket `ticket` (launched just before).
    Device { ticket: u64, pick: usize },
    /// Not known yet: wait until the step with this ticket is read back, then ask again.
    Wait(u64),
    /// Nothing was drawn for it.
    None,
}

/// Cache length of every sequence this rank has executed, plus the fault hook.
#[derive(Debug, Default)]
pub struct SeqTable {
    lens: HashMap<u64, u32>,
    /// The token this rank last drew for each sequence (overlapped decode feeds it next), or
    /// the launched step that will draw it.
    draws: HashMap<u64, Draw>,
    /// Overlapped decode: whether each device-fed token was the token drawn (by the step that
    /// drew it: (sequence, compute ticket) -> same), for the step that fed it to check.
    fed_checks: HashMap<(u64, u64), bool>,
    fault: Option<TestFault>,
    steps_done: u64,
    fault_fired: bool,
}

impl SeqTable {
    /// An empty table, with an optional test fault.
    pub fn new(fault: Option<TestFault>) -> Self {
        Self { fault, ..Default::default() }
    }

    /// This rank's cache length of `seq_id` (0 if unknown).
    pub fn len(&self, seq_id: u64) -> u32 {
        self.lens.get(&seq_id).copied().unwrap_or(0)
    }

    /// Whether this rank tracks `seq_id` (not released or dropped).
    pub fn knows(&self, seq_id: u64) -> bool {
        self.lens.contains_key(&seq_id)
    }

    /// Number of sequences tracked.
    pub fn n_seqs(&self) -> usize {
        self.lens.len()
    }

    /// The handshake check of one sequence: a known sequence must match exactly; an unknown one
    /// must start at 0 unless it adopts a cached prefix.
    pub fn check(&self, seq_id: u64, expected: u32, adopt_prefix: bool) -> Verdict {
        match self.lens.get(&seq_id) {
            Some(&actual) if actual == expected => Verdict::Ok,
            Some(&actual) => Verdict::LengthMismatch { actual },
            None if expected == 0 || adopt_prefix => Verdict::Ok,
            None => Verdict::LengthMismatch { actual: 0 },
        }
    }

    /// Records that a step ran `n_new` tokens of `seq_id` after `expected` cached ones.
    pub fn advance(&mut self, seq_id: u64, expected: u32, n_new: u32, first_in_step: bool) {
        let mut len = expected + n_new;
        match self.fault {
            Some(TestFault::WrongCacheLen { seq_id: s }) if s == seq_id => {
                tracing::warn!(seq_id, "TEST FAULT: recording a wrong cache length");
                len += 1;
            }
            Some(TestFault::WrongCacheLenAfterSteps { n }) if first_in_step && !self.fault_fired && self.steps_done >= n => {
                tracing::warn!(seq_id, "TEST FAULT: recording a wrong cache length");
                self.fault_fired = true;
                len += 1;
            }
            _ => {}
        }
        self.lens.insert(seq_id, len);
    }

    /// Counts an executed step (for `wrong-cache-len-after-steps`).
    pub fn step_done(&mut self) {
        self.steps_done += 1;
    }

    /// Forgets a sequence.
    pub fn forget(&mut self, seq_id: u64) {
        self.lens.remove(&seq_id);
        self.draws.remove(&seq_id);
        self.fed_checks.retain(|k, _| k.0 != seq_id);
    }

    /// Records the token this rank drew for `seq_id` in the step that just computed.
    pub fn set_draw(&mut self, seq_id: u64, token: u32) {
        self.draws.insert(seq_id, Draw::Token(token));
    }

    /// Records that the launched step `ticket` draws for `seq_id` (read back later).
    pub fn expect_draw(&mut self, seq_id: u64, ticket: u64, pick: Option<usize>) {
        self.draws.insert(seq_id, Draw::Pending { ticket, pick });
    }

    /// The launched step `ticket` was read back: its draw for `seq_id` (None: none) replaces
    /// the pending entry, unless a step fed the device pick meanwhile (it took the entry).
    /// Returns whether the entry was gone (taken by a device feed, or the sequence forgotten).
    pub fn resolve_draw(&mut self, seq_id: u64, ticket: u64, token: Option<u32>) -> bool {
        if matches!(self.draws.get(&seq_id), Some(Draw::Pending { ticket: t, .. }) if *t == ticket) {
            match token {
                Some(t) => self.draws.insert(seq_id, Draw::Token(t)),
                None => self.draws.remove(&seq_id),
            };
            false
        } else {
            true
        }
    }

    /// How the step with compute ticket `ticket` would feed `seq_id`'s last draw: the host
    /// token, or (from the step launched just before, when its row allows and `device` says
    /// this step can) the device pick. [`SeqTable::drop_draw`] takes it.
    pub fn feed(&self, seq_id: u64, ticket: u64, device: bool) -> Feed {
        match self.draws.get(&seq_id).copied() {
            None => Feed::None,
            Some(Draw::Token(t)) => Feed::Token(t),
            Some(Draw::Pending { ticket: t, pick: Some(pick) }) if device && t + 1 == ticket => Feed::Device { ticket: t, pick },
            Some(Draw::Pending { ticket: t, .. }) => Feed::Wait(t),
        }
    }

    /// Forgets `seq_id`'s last draw (a step fed it).
    pub fn drop_draw(&mut self, seq_id: u64) {
        self.draws.remove(&seq_id);
    }

    /// The step `ticket` was read back: whether its device pick for `seq_id` was its drawn
    /// token (for a step that fed the pick).
    pub fn set_fed_check(&mut self, seq_id: u64, ticket: u64, same: bool) {
        // The step that fed it is answered right after this one: older checks are stale (their
        // sequence failed or was released before they were read).
        self.fed_checks.retain(|k, _| k.1 + 8 > ticket);
        self.fed_checks.insert((seq_id, ticket), same);
    }

    /// Whether the device pick the step after `ticket` fed for `seq_id` was the drawn token
    /// (false when unknown), taken once.
    pub fn take_fed_check(&mut self, seq_id: u64, ticket: u64) -> bool {
        self.fed_checks.remove(&(seq_id, ticket)) == Some(true)
    }

    /// Keeps at most `keep_len` positions of a known sequence.
    pub fn truncate(&mut self, seq_id: u64, keep_len: u32) {
        if let Some(l) = self.lens.get_mut(&seq_id) {
            *l = (*l).min(keep_len);
        }
        self.draws.remove(&seq_id);
        self.fed_checks.retain(|k, _| k.0 != seq_id);
    }

    /// Forgets everything (the world was torn down; the KV cache is not trusted any more).
    pub fn clear(&mut self) {
        self.lens.clear();
        self.draws.clear();
        self.fed_checks.clear();
    }
}

/// What one rank says about a step before anyone computes: identifies the step and gives its
/// verdict on every sequence. Every rank gathers every rank's record and derives the same
/// decision from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    pub step_id: u64,
    pub page_size: u32,
    pub n_pages: u32,
    /// `(seq_id, verdict code, this rank's length)` in request order.
    pub seqs: Vec<(u64, u8, u32)>,
}

impl StepRecord {
    /// Builds this rank's record from its verdicts.
    pub fn new(step_id: u64, page_size: u32, n_pages: u32, verdicts: &[(u64, &Verdict, u32)]) -> Self {
        Self { step_id, page_size, n_pages, seqs: verdicts.iter().map(|&(s, v, len)| (s, v.code(), len)).collect() }
    }

    /// Little-endian wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(20 + self.seqs.len() * 13);
        b.extend_from_slice(&self.step_id.to_le_bytes());
        b.extend_from_slice(&self.page_size.to_le_bytes());
        b.extend_from_slice(&self.n_pages.to_le_bytes());
        b.extend_from_slice(&(self.seqs.len() as u32).to_le_bytes());
        for &(s, c, l) in &self.seqs {
            b.extend_from_slice(&s.to_le_bytes());
            b.push(c);
            b.extend_from_slice(&l.to_le_bytes());
        }
        b
    }

    /// Parses [`StepRecord::encode`]'s output.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let u32_at = |i: usize| b.get(i..i + 4).map(|x| u32::from_le_bytes(x.try_into().unwrap()));
        let u64_at = |i: usize| b.get(i..i + 8).map(|x| u64::from_le_bytes(x.try_into().unwrap()));
        let step_id = u64_at(0)?;
        let (page_size, n_pages, n) = (u32_at(8)?, u32_at(12)?, u32_at(16)? as usize);
        let mut seqs = Vec::with_capacity(n.min(1 << 16));
        let mut i = 20;
        for _ in 0..n {
            seqs.push((u64_at(i)?, *b.get(i + 8)?, u32_at(i + 9)?));
            i += 13;
        }
        (i == b.len()).then_some(Self { step_id, page_size, n_pages, seqs })
    }
}

/// The decision every rank derives from all ranks' records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Agreement {
    /// Per sequence (request order): `None` = run it; `Some(why)` = dropped on every rank.
    Seqs(Vec<Option<Dropped>>),
    /// The ranks were not given the same step (a gateway bug): nobody computes.
    Diverged(String),
}

/// Why a sequence was dropped from a step on all ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// Whether any rank's cache length disagreed (the sequence is then forgotten everywhere).
    pub length_mismatch: bool,
    pub message: String,
}

/// Derives the agreement from every rank's record (indexed by rank), given what the gateway
/// expected for each sequence and this rank's own local error details.
pub fn agree(records: &[StepRecord], expected: &[u32], local_invalid: &[Option<String>]) -> Agreement {
    let first = &records[0];
    for (r, rec) in records.iter().enumerate() {
        if rec.step_id != first.step_id
            || rec.page_size != first.page_size
            || rec.n_pages != first.n_pages
            || rec.seqs.len() != first.seqs.len()
            || rec.seqs.iter().zip(&first.seqs).any(|(a, b)| a.0 != b.0)
        {
            return Agreement::Diverged(format!(
                "rank {r} got a different step (step {} with {} sequences, kv {}x{}) than rank 0 (step {} with {} sequences, kv {}x{})",
                rec.step_id,
                rec.seqs.len(),
                rec.n_pages,
                rec.page_size,
                first.step_id,
                first.seqs.len(),
                first.n_pages,
                first.page_size
            ));
        }
    }
    let mut out = Vec::with_capacity(first.seqs.len());
    for (i, &exp) in expected.iter().enumerate() {
        let mismatched: Vec<(usize, u32)> =
            records.iter().enumerate().filter(|(_, r)| r.seqs[i].1 == 1).map(|(rank, r)| (rank, r.seqs[i].2)).collect();
        let invalid: Vec<usize> = records.iter().enumerate().filter(|(_, r)| r.seqs[i].1 == 2).map(|(rank, _)| rank).collect();
        if mismatched.is_empty() && invalid.is_empty() {
            out.push(None);
            continue;
        }
        let lens: Vec<String> = records.iter().enumerate().map(|(rank, r)| format!("rank {rank}: {}", r.seqs[i].2)).collect();
        let message = if !mismatched.is_empty() {
            format!(
                "KV cache length mismatch for sequence {}: gateway expected {exp}, ranks have [{}]; sequence dropped on all ranks",
                first.seqs[i].0,
                lens.join(", ")
            )
        } else {
            let detail = local_invalid.get(i).cloned().flatten().unwrap_or_else(|| format!("invalid on ranks {invalid:?}"));
            format!("sequence {} not executed: {detail}", first.seqs[i].0)
        };
        out.push(Some(Dropped { length_mismatch: !mismatched.is_empty(), message }));
    }
    Agreement::Seqs(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_tokens_feed_from_the_host_or_the_device_pick_of_the_step_just_before() {
        let mut t = SeqTable::new(None);
        assert_eq!(t.feed(1, 5, true), Feed::None);
        t.expect_draw(1, 5, Some(2));
        t.expect_draw(2, 5, None);
        // The next ticket feeds the pick where it may; otherwise it waits for ticket 5.
        assert_eq!(t.feed(1, 6, true), Feed::Device { ticket: 5, pick: 2 });
        assert_eq!(t.feed(1, 6, false), Feed::Wait(5));
        assert_eq!(t.feed(1, 7, true), Feed::Wait(5), "a later ticket: the pick was overwritten");
        assert_eq!(t.feed(2, 6, true), Feed::Wait(5), "no pick (e.g. a sampled row)");
        t.drop_draw(1);
        // Read back: the taken entry stays taken (its check is recorded), the other gets its token.
        assert!(t.resolve_draw(1, 5, Some(40)));
        assert!(!t.resolve_draw(2, 5, Some(41)));
        assert_eq!(t.feed(2, 6, true), Feed::Token(41));
        t.drop_draw(2);
        assert_eq!(t.feed(2, 6, true), Feed::None, "fed once");
        // Checks are per (sequence, ticket): the next step's own record does not hide this one.
        t.set_fed_check(1, 5, true);
        t.set_fed_check(1, 6, false);
        assert!(t.take_fed_check(1, 5));
        assert!(!t.take_fed_check(1, 5), "taken once");
        assert!(!t.take_fed_check(1, 6));
        t.set_fed_check(3, 6, true);
        t.forget(3);
        assert!(!t.take_fed_check(3, 6));
    }

    #[test]
    fn check_known_unknown_and_adopted_sequences() {
        let mut t = SeqTable::new(None);
        assert_eq!(t.check(1, 0, false), Verdict::Ok);
        assert_eq!(t.check(1, 5, false), Verdict::LengthMismatch { actual: 0 });
        assert_eq!(t.check(1, 64, true), Verdict::Ok);
        t.advance(1, 0, 7, true);
        assert_eq!(t.check(1, 7, false), Verdict::Ok);
        assert_eq!(t.check(1, 6, false), Verdict::LengthMismatch { actual: 7 });
        assert_eq!(t.check(1, 6, true), Verdict::LengthMismatch { actual: 7 });
        t.truncate(1, 3);
        assert_eq!(t.len(1), 3);
        t.forget(1);
        assert_eq!(t.len(1), 0);
    }

    #[test]
    fn faults_mis_track() {
        let mut t = SeqTable::new(Some("wrong-cache-len:9".parse().unwrap()));
        t.advance(8, 0, 4, true);
        t.advance(9, 0, 4, false);
        assert_eq!((t.len(8), t.len(9)), (4, 5));
        let mut t = SeqTable::new(Some("wrong-cache-len-after-steps:1".parse().unwrap()));
        t.advance(1, 0, 4, true);
        t.step_done();
        t.advance(2, 0, 4, true);
        t.advance(3, 0, 4, false);
        t.step_done();
        t.advance(4, 0, 4, true);
        assert_eq!((t.len(1), t.len(2), t.len(3), t.len(4)), (4, 5, 4, 4));
        assert!("bogus:1".parse::<TestFault>().is_err());
    }

    #[test]
    fn records_round_trip_and_agreement_is_symmetric() {
        let ok = Verdict::Ok;
        let bad = Verdict::LengthMismatch { actual: 8 };
        let r0 = StepRecord::new(3, 64, 10, &[(1, &ok, 7), (2, &ok, 0)]);
        let r1 = StepRecord::new(3, 64, 10, &[(1, &bad, 8), (2, &ok, 0)]);
        assert_eq!(StepRecord::decode(&r0.encode()), Some(r0.clone()));
        assert_eq!(StepRecord::decode(&r0.encode()[1..]), None);
        let a = agree(&[r0.clone(), r1.clone()], &[7, 0], &[None, None]);
        let Agreement::Seqs(s) = a else { panic!() };
        assert!(s[1].is_none());
        let d = s[0].as_ref().unwrap();
        assert!(d.length_mismatch && d.message.contains("rank 1: 8"), "{}", d.message);
        let r2 = StepRecord::new(4, 64, 10, &[(1, &ok, 7), (2, &ok, 0)]);
        assert!(matches!(agree(&[r0, r2], &[7, 0], &[None, None]), Agreement::Diverged(_)));
    }
}
