//! A byte-at-a-time JSON matcher for a compiled schema ([`Grammar`]): a pushdown automaton
//! whose state is a small set of [`Thread`]s (more than one only while `anyOf` alternatives,
//! or a literal and a longer one, are both still possible).
//!
//! Every state it accepts can still be completed into a document that satisfies the schema
//! (the schema compiler refuses schemas where that fails), so masking tokens by this matcher
//! never leaves the model without a way to finish. Two bounds keep every document finite and
//! sane: a whitespace run between tokens is at most [`MAX_WS`] bytes, a number at most
//! [`MAX_NUMBER`] bytes with an exponent of at most two digits (so it fits an f64).

use std::sync::Arc;

use super::regex::{Dfa, MAX_CHAR};
use super::schema::{ByteTrie, Grammar, Node, NodeId, UNBOUNDED};

/// Most threads a state keeps (alternatives still open at once); more are dropped, which only
/// narrows what may be written (every kept thread can still complete).
pub const MAX_THREADS: usize = 32;
/// Deepest nesting of frames (serde_json refuses documents nested deeper than 128).
pub const MAX_DEPTH: u16 = 100;

/// Longest run of whitespace allowed between JSON tokens.
pub const MAX_WS: u8 = 48;
/// Longest number, in bytes.
pub const MAX_NUMBER: u8 = 32;
/// Most digits of a bounded number (`Node::Decimal`, plain decimal notation): any such
/// decimal reads as a distinct f64, so a bound that holds for the written digits holds for
/// the float a client parses them to, exclusive bounds included.
pub const DEC_DIGITS: u8 = 15;
const NO_KEY: u32 = u32::MAX;

/// Where inside a string's characters the matcher is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StrSub {
    Plain,
    /// After a backslash.
    Esc,
    /// Hex digits of `\u` still to come; `first`: the first digit's value (16 before it),
    /// `low`: this escape must be a low surrogate (the second half of a pair), `high`: it is a
    /// high surrogate so far.
    Hex { left: u8, first: u8, low: bool, high: bool },
    /// After a high surrogate's escape: its low half must follow (`\` then `u`).
    PairEsc,
    PairU,
    /// UTF-8 continuation bytes still to come, and the range of the next one.
    Utf8 { need: u8, lo: u8, hi: u8 },
}

/// Where inside a patterned string's characters the matcher is: [`StrSub`] with the value of
/// the character being written, so the automaton can be stepped when it completes (and every
/// partial character is kept only while some completion of it continues the automaton).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PSub {
    Plain,
    Esc,
    /// `\u` hex digits: `left` still to come, `acc` their value so far; `high`: the high
    /// surrogate this escape is the low half of (0: a first escape).
    Hex { left: u8, acc: u16, high: u16 },
    /// After high surrogate `high`'s escape: `\` then `u` of its low half.
    PairEsc { high: u16 },
    PairU { high: u16 },
    /// UTF-8 continuation bytes still to come, the range of the next one, the bits so far.
    Utf8 { need: u8, lo: u8, hi: u8, acc: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum NumSt {
    Minus,
    Zero,
    Int,
    FracStart,
    Frac,
    ExpStart,
    ExpSign,
    Exp,
    /// Two exponent digits: no more (every number fits an f64, which many parsers need).
    Exp2,
}

impl NumSt {
    fn accepting(self) -> bool {
        matches!(self, NumSt::Zero | NumSt::Int | NumSt::Frac | NumSt::Exp | NumSt::Exp2)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Seq {
    /// After the opening bracket / brace.
    Open,
    /// Waiting for the child frame above (a value, or an object key).
    Child,
    /// After a key: expecting `:`.
    Colon,
    /// After an element / member.
    Item,
    /// After a comma.
    Comma,
    /// Waiting for a tag child (tool calls).
    Tag,
    /// Waiting for a name child (tool calls).
    Name,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Frame {
    /// Before a value of `node` (whitespace allowed).
    Value { node: NodeId },
    /// Inside literal trie `trie` at node `at`.
    Lit { trie: u32, at: u32 },
    /// Inside a string value, after its opening quote; `chars` counted only when bounded.
    Str { min: u32, max: u32, chars: u32, sub: StrSub },
    /// Inside a string value with an automaton (`Grammar::dfas[dfa]`, in state `ds`).
    PStr { dfa: u32, ds: u32, sub: PSub },
    /// Inside raw text with an automaton (`Node::RawPattern`; `sub`: `Plain` or `Utf8`).
    RawPStr { dfa: u32, ds: u32, sub: PSub },
    /// Inside an object key of object `obj`: the declared-key trie position (`NO_KEY` once the
    /// text left every declared key), and whether other keys are allowed.
    Key { obj: NodeId, at: u32, free: bool, sub: StrSub },
    Num { st: NumSt, len: u8 },
    /// An integer (`Node::Int`): its sign, the digits' value and count so far (0: only
    /// the sign).
    Int { node: NodeId, neg: bool, v: u64, k: u8 },
    /// A bounded number (`Node::Decimal`): its sign, its digits so far as one integer `m`
    /// (`ki` before the point, `kf` after it), and whether the point was written.
    Dec { node: NodeId, neg: bool, point: bool, ki: u8, kf: u8, m: u64 },
    Arr { node: NodeId, count: u32, st: Seq },
    /// `cur`: the property whose value is being written (index, or `NO_KEY` for an additional
    /// one).
    Obj { node: NodeId, seen: u64, st: Seq, cur: u32 },
    /// After the document: only whitespace.
    End,
    /// Before a value of `node` with no whitespace first (tool-call parameter values).
    Tight { node: NodeId },
    /// Element `i` of a chain is being written; `i == len`: all written (may end here).
    Chain { node: NodeId, i: u32 },
    /// Raw text up to its closing tag (`Grammar::texts[close]`), `k` bytes of the tag matched.
    Raw { close: u32, k: u32 },
    /// One of a tag trie's strings, among the alternatives `allow` (bits of string indices).
    Tag { trie: u32, at: u32, allow: u64 },
    /// A name between `name="` and `">` (a tool's, or a parameter's of `owner`): the trie
    /// position (`NO_KEY` off every declared name), whether other names are allowed, and once
    /// the quote came (`quote`), the name's index in `at`.
    Name { owner: NodeId, at: u32, free: bool, quote: bool, len: u16 },
    /// A tool-call block's invokes (`count` so far).
    Calls { node: NodeId, count: u32, st: Seq },
    /// One invoke's parameters.
    Params { node: NodeId, seen: u64, st: Seq },
}

/// A patterned string's position for the masks' fast path ([`State::in_pattern`]).
pub struct PatView {
    dfa: u32,
    /// The automaton's state and the character in progress where the view was taken.
    pub ds: u32,
    pub sub: PSub,
    /// The state right after the closing quote (`None`: nothing may follow it).
    pub after: Option<State>,
}

/// One byte of a patterned string ([`PatView::step`]).
pub enum PatStep {
    /// Still inside the string.
    In(u32, PSub),
    /// The closing quote (the string may end here).
    Close,
    Dead,
}

impl PatView {
    /// Byte `b` from (`ds`, `sub`), as the matcher's `PStr` frame takes it.
    pub fn step(&self, g: &Grammar, ds: u32, sub: PSub, b: u8) -> PatStep {
        pstr_step(&g.dfas[self.dfa as usize], ds, sub, b)
    }

    /// Byte `b` of patterned raw text from (`ds`, `sub`), staying inside it, as the matcher's
    /// `RawPStr` frame takes it ([`State::in_raw_pattern`]).
    pub fn step_raw(&self, g: &Grammar, ds: u32, sub: PSub, b: u8) -> Option<(u32, PSub)> {
        raw_text_byte(&g.dfas[self.dfa as usize], ds, sub, b)
    }

    /// Whether the text may end at (`ds`, `sub`) (raw text: the next byte goes to `after`).
    pub fn may_end(&self, g: &Grammar, ds: u32, sub: PSub) -> bool {
        sub == PSub::Plain && g.dfas[self.dfa as usize].accepts(ds)
    }
}

/// Byte `b` of a patterned string from (`ds`, `sub`): the one definition the matcher's `PStr`
/// frame and the masks' fast path share.
fn pstr_step(d: &Dfa, ds: u32, sub: PSub, b: u8) -> PatStep {
    if sub == PSub::Plain && b == b'"' {
        return if d.accepts(ds) { PatStep::Close } else { PatStep::Dead };
    }
    match pstr_byte(d, ds, sub, b) {
        Some((ds, sub)) => PatStep::In(ds, sub),
        None => PatStep::Dead,
    }
}

/// Longest tool or parameter name (the tool-call parser's limit).
const MAX_NAME: u16 = 256;

/// What a parent does next once its child completed.
enum Next {
    /// Its new state.
    Top(Frame),
    /// Its new state, with a new child on top.
    Push(Frame, Frame),
    /// It completed too.
    Complete,
}

#[derive(Debug, PartialEq, Eq, Hash)]
struct Link {
    frame: Frame,
    below: Option<Arc<Link>>,
}

/// One possible parse: the frame on top, the stack below it (shared between threads), and the
/// length of the current whitespace run.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Thread {
    top: Frame,
    below: Option<Arc<Link>>,
    ws: u8,
    /// Frames below the top.
    depth: u16,
}

impl Thread {
    fn with_top(&self, top: Frame) -> Thread {
        Thread { top, below: self.below.clone(), ws: 0, depth: self.depth }
    }

    /// `child` on top of this thread's stack with `parent` replacing its top.
    fn push(&self, parent: Frame, child: Frame) -> Thread {
        Thread { top: child, below: Some(Arc::new(Link { frame: parent, below: self.below.clone() })), ws: 0, depth: self.depth + 1 }
    }

    /// The stack below the top, with the parent told that its child completed.
    fn pop(&self, g: &Grammar, key: Option<u32>) -> Option<Thread> {
        let link = self.below.as_ref()?;
        Some(match child_done(g, link.frame, key)? {
            Next::Top(parent) => Thread { top: parent, below: link.below.clone(), ws: 0, depth: self.depth - 1 },
            Next::Push(parent, child) => {
                Thread { top: child, below: Some(Arc::new(Link { frame: parent, below: link.below.clone() })), ws: 0, depth: self.depth }
            }
            Next::Complete => Thread { top: link.frame, below: link.below.clone(), ws: 0, depth: self.depth - 1 }.pop(g, None)?,
        })
    }
}

/// A matcher state: the set of live threads.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    threads: Vec<Thread>,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl State {
    /// Before the document's first byte.
    pub fn start(g: &Grammar) -> State {
        let end = Arc::new(Link { frame: Frame::End, below: None });
        State { threads: vec![Thread { top: Frame::Value { node: g.root }, below: Some(end), ws: 0, depth: 1 }] }
    }

    /// How many parses are open at once.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Whether every thread finished the document (only whitespace may follow).
    pub fn at_end(&self) -> bool {
        !self.threads.is_empty() && self.threads.iter().all(|t| t.top == Frame::End)
    }

    /// Whether no thread is left (the bytes so far cannot start a valid document).
    pub fn is_dead(&self) -> bool {
        self.threads.is_empty()
    }

    /// Whether the document may end here.
    pub fn can_end(&self, g: &Grammar) -> bool {
        self.threads.iter().any(|t| can_end(g, t))
    }

    /// The state after byte `b` (possibly dead).
    pub fn step(&self, g: &Grammar, b: u8) -> State {
        let mut out = Vec::with_capacity(self.threads.len());
        for t in &self.threads {
            step_thread(g, t, b, &mut out);
        }
        out.retain(|t| t.depth <= MAX_DEPTH);
        if out.len() > 1 {
            dedup(&mut out);
            out.truncate(MAX_THREADS);
        }
        State { threads: out }
    }

    /// When the state is one thread inside a string value: that string's view (the masks'
    /// fast path: which tokens stay inside a string does not depend on the stack below).
    pub fn in_string(&self) -> Option<StrView> {
        match self.threads.as_slice() {
            [t @ Thread { top: Frame::Str { min, max, chars, sub }, .. }] => Some(StrView { min: *min, max: *max, chars: *chars, sub: *sub, bounded: *min > 0 || *max != UNBOUNDED, thread: t.clone() }),
            _ => None,
        }
    }

    /// When the state is one thread inside a patterned string (`pattern` / `format`): its view
    /// (the masks' fast path: a token's bytes inside the string step only the automaton).
    pub fn in_pattern(&self, g: &Grammar) -> Option<PatView> {
        let [t] = self.threads.as_slice() else { return None };
        let Frame::PStr { dfa, ds, sub } = t.top else { return None };
        Some(PatView { dfa, ds, sub, after: t.pop(g, None).map(|p| State { threads: vec![p] }) })
    }

    /// When the state is one thread inside a patterned string parameter's raw text (or just
    /// before it): its view, `after` being the state once the text ended (the masks' fast
    /// path: a token's bytes step only the automaton until the text may end).
    pub fn in_raw_pattern(&self, g: &Grammar) -> Option<PatView> {
        let [t] = self.threads.as_slice() else { return None };
        let (dfa, ds, sub) = match t.top {
            Frame::RawPStr { dfa, ds, sub } => (dfa, ds, sub),
            Frame::Tight { node } => match g.nodes[node as usize] {
                Node::RawPattern(dfa) => (dfa, Dfa::START, PSub::Plain),
                _ => return None,
            },
            _ => return None,
        };
        Some(PatView { dfa, ds, sub, after: t.pop(g, None).map(|p| State { threads: vec![p] }) })
    }

    /// When the state is one thread inside an object key where other keys are allowed: the key
    /// (the masks' fast path: each token is checked by a plain loop over its bytes instead of
    /// stepping states).
    pub fn in_free_key(&self) -> Option<KeyView> {
        let [t] = self.threads.as_slice() else { return None };
        let Frame::Key { obj, at, free: true, sub } = t.top else { return None };
        let Some(Frame::Obj { seen, .. }) = t.below.as_ref().map(|l| l.frame) else { return None };
        Some(KeyView { thread: t.clone(), obj, at, sub, seen })
    }

    /// When the state is one thread inside raw text (a tool call's string value): its closing
    /// tag, the bytes of it matched, and the state right after the tag (the masks' fast path:
    /// raw text takes any token that does not complete the tag).
    pub fn in_raw(&self, g: &Grammar) -> Option<(u32, u32, Option<State>)> {
        let [t] = self.threads.as_slice() else { return None };
        let (close, k) = match t.top {
            Frame::Raw { close, k } => (close, k),
            Frame::Tight { node } => match g.nodes[node as usize] {
                Node::Raw(close) => (close, 0),
                _ => return None,
            },
            _ => return None,
        };
        Some((close, k, t.pop(g, None).map(|p| State { threads: vec![p] })))
    }

    /// Steps `out` in place through `bytes`; false (and `out` dead) when they do not fit.
    pub fn feed(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        for &b in bytes {
            *self = self.step(g, b);
            if self.is_dead() {
                return false;
            }
        }
        true
    }
}

/// One thread inside an object key that may be any key (see [`State::in_free_key`]).
#[derive(Clone, Debug)]
pub struct KeyView {
    thread: Thread,
    obj: NodeId,
    at: u32,
    sub: StrSub,
    seen: u64,
}

impl KeyView {
    /// Whether `bytes` keep the key valid (what [`key_byte`] would say byte by byte); a token
    /// that closes the key runs on through the state after it.
    pub fn admits(&self, g: &Grammar, bytes: &[u8]) -> bool {
        let Node::Object { keys, .. } = &g.nodes[self.obj as usize] else { return false };
        let trie = &g.keys[*keys as usize];
        let (mut at, mut sub) = (self.at, self.sub);
        for (i, &b) in bytes.iter().enumerate() {
            if sub == StrSub::Plain && b == b'"' {
                let declared = (at != NO_KEY).then(|| trie.nodes[at as usize].end).flatten();
                let key = match declared {
                    Some(k) if self.seen & (1 << k) == 0 => k,
                    Some(_) => return false,
                    None => NO_KEY,
                };
                let Some(p) = self.thread.pop(g, Some(key)) else { return false };
                return State { threads: vec![p] }.feed(g, &bytes[i + 1..]);
            }
            let Some((nsub, _)) = str_byte(sub, b) else { return false };
            let Some(nat) = follow_name(trie, at, b, true, self.seen) else { return false };
            if (!matches!(sub, StrSub::Plain | StrSub::Utf8 { .. }) || b == b'\\') && nat == NO_KEY {
                return false;
            }
            (at, sub) = (nat, nsub);
        }
        true
    }
}

/// One thread inside a string value (see [`State::in_string`]).
#[derive(Clone, Debug)]
pub struct StrView {
    pub min: u32,
    pub max: u32,
    /// Characters so far (counted only when `bounded`).
    pub chars: u32,
    pub sub: StrSub,
    pub bounded: bool,
    thread: Thread,
}

impl StrView {
    /// The state right after the string's closing quote (`None`: it may not close here, or
    /// its parent takes no value end).
    pub fn after_close(&self, g: &Grammar) -> Option<State> {
        self.thread.pop(g, None).map(|t| State { threads: vec![t] })
    }

    /// Whether a token whose bytes run as `run` from this view keeps the string valid up to
    /// its end or its closing quote (what follows a closing quote is the caller's to check).
    pub fn admits(&self, run: &StrRun) -> bool {
        // Every character a token starts must start below the maximum: the k-th start sees the
        // characters completed before it, the one in progress (if any) included.
        let mid = u32::from(self.sub != StrSub::Plain);
        let fits = |starts: u32| !self.bounded || starts == 0 || self.chars + mid + starts <= self.max;
        match *run {
            StrRun::Dead => false,
            StrRun::Inside { starts } => fits(starts),
            StrRun::Closes { starts, done, .. } => fits(starts) && self.chars + done >= self.min,
        }
    }
}

/// What a token's bytes do to a string's content from some sub-state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StrRun {
    /// A byte no string may hold there.
    Dead,
    /// Every byte stays inside the string; `starts`: characters begun.
    Inside { starts: u32 },
    /// The closing quote is byte `at`; `starts` characters were begun and `done` completed
    /// before it.
    Closes { at: u32, starts: u32, done: u32 },
}

/// Where `bytes`, read from raw text with `k` bytes of its closing `tag` matched, complete the
/// tag: the index just past it, or `None` when they stay inside the text.
pub fn raw_run(tag: &[u8], mut k: usize, bytes: &[u8]) -> Option<usize> {
    for (i, &b) in bytes.iter().enumerate() {
        if b == tag[k] {
            k += 1;
            if k == tag.len() {
                return Some(i + 1);
            }
        } else {
            k = usize::from(b == tag[0]);
        }
    }
    None
}

/// Runs `bytes` through a string's content from `sub` (length bounds are [`StrView::admits`]'s).
pub fn str_run(mut sub: StrSub, bytes: &[u8]) -> StrRun {
    let (mut starts, mut done) = (0u32, 0u32);
    for (i, &b) in bytes.iter().enumerate() {
        if sub == StrSub::Plain && b == b'"' {
            return StrRun::Closes { at: i as u32, starts, done };
        }
        if sub == StrSub::Plain {
            starts += 1;
        }
        match str_byte(sub, b) {
            Some((n, completed)) => {
                sub = n;
                done += u32::from(completed);
            }
            None => return StrRun::Dead,
        }
    }
    StrRun::Inside { starts }
}

fn dedup(v: &mut Vec<Thread>) {
    let mut i = 0;
    while i < v.len() {
        if v[..i].contains(&v[i]) {
            v.swap_remove(i);
        } else {
            i += 1;
        }
    }
}

fn can_end(g: &Grammar, t: &Thread) -> bool {
    match t.top {
        Frame::End => true,
        Frame::Num { st, .. } if st.accepting() => t.pop(g, None).is_some_and(|p| can_end(g, &p)),
        Frame::Int { node, neg, v, k } if int_ends(g, node, neg, v, k) => t.pop(g, None).is_some_and(|p| can_end(g, &p)),
        Frame::RawPStr { dfa, ds, sub: PSub::Plain } if g.dfas[dfa as usize].accepts(ds) => t.pop(g, None).is_some_and(|p| can_end(g, &p)),
        Frame::Dec { node, neg, point, ki, kf, m } if dec_ends(g, node, neg, point, ki, kf, m) => t.pop(g, None).is_some_and(|p| can_end(g, &p)),
        Frame::Lit { trie, at } if g.lits[trie as usize].nodes[at as usize].end.is_some() => {
            t.pop(g, None).is_some_and(|p| can_end(g, &p))
        }
        Frame::Chain { node, i } if i as usize == chain_len(g, node) => t.pop(g, None).is_some_and(|p| can_end(g, &p)),
        _ => false,
    }
}

fn chain_len(g: &Grammar, node: NodeId) -> usize {
    match &g.nodes[node as usize] {
        Node::Chain { items, .. } => items.len(),
        _ => 0,
    }
}

/// The frame that waits for a value of `node`: whitespace first unless the node is tight.
fn value_frame(g: &Grammar, node: NodeId) -> Frame {
    let tight = match &g.nodes[node as usize] {
        Node::Raw(_) => true,
        Node::Chain { tight, .. } => *tight,
        _ => false,
    };
    if tight { Frame::Tight { node } } else { Frame::Value { node } }
}

/// The parent's next step once its child (a value, a key with the property it named, a tag
/// with the alternative it was, a name with its index) completed.
fn child_done(g: &Grammar, parent: Frame, key: Option<u32>) -> Option<Next> {
    Some(match parent {
        Frame::Arr { node, count, st: Seq::Child } => Next::Top(Frame::Arr { node, count: count + 1, st: Seq::Item }),
        Frame::Obj { node, seen, st: Seq::Child, cur } => match key {
            // A key completed: remember which property it named; expect ':'.
            Some(k) => {
                let seen = if k == NO_KEY { seen } else { seen | (1 << k) };
                Next::Top(Frame::Obj { node, seen, st: Seq::Colon, cur: k })
            }
            None => Next::Top(Frame::Obj { node, seen, st: Seq::Item, cur }),
        },
        Frame::End => Next::Top(Frame::End),
        Frame::Chain { node, i } => {
            let Node::Chain { items, tight } = &g.nodes[node as usize] else { return None };
            let i = i as usize + 1;
            match items.get(i) {
                Some(&next) => {
                    let child = if *tight { Frame::Tight { node: next } } else { Frame::Value { node: next } };
                    Next::Push(Frame::Chain { node, i: i as u32 }, child)
                }
                None => Next::Top(Frame::Chain { node, i: i as u32 }),
            }
        }
        // Tool-call blocks: tag 0 opens an invoke, tag 1 closes the block.
        Frame::Calls { node, count, st: Seq::Tag } => match key? {
            0 => Next::Push(Frame::Calls { node, count, st: Seq::Name }, Frame::Name { owner: node, at: 0, free: false, quote: false, len: 0 }),
            _ => Next::Complete,
        },
        Frame::Calls { node, count, st: Seq::Name } => {
            let Node::Calls { bodies, .. } = &g.nodes[node as usize] else { return None };
            let body = *bodies.get(key? as usize)?;
            Next::Push(Frame::Calls { node, count: count + 1, st: Seq::Child }, Frame::Params { node: body, seen: 0, st: Seq::Open })
        }
        Frame::Calls { node, count, st: Seq::Child } => Next::Top(Frame::Calls { node, count, st: Seq::Item }),
        // Invokes: tag 0 opens a parameter, tag 1 closes the invoke.
        Frame::Params { node, seen, st: Seq::Tag } => match key? {
            0 => {
                let free = matches!(&g.nodes[node as usize], Node::Params { free: Some(_), .. });
                Next::Push(Frame::Params { node, seen, st: Seq::Name }, Frame::Name { owner: node, at: 0, free, quote: false, len: 0 })
            }
            _ => Next::Complete,
        },
        Frame::Params { node, seen, st: Seq::Name } => {
            let Node::Params { values, free, .. } = &g.nodes[node as usize] else { return None };
            let k = key?;
            let (value, seen) = if k == NO_KEY { ((*free)?, seen) } else { (*values.get(k as usize)?, seen | (1 << k)) };
            Next::Push(Frame::Params { node, seen, st: Seq::Child }, value_frame(g, value))
        }
        Frame::Params { node, seen, st: Seq::Child } => Next::Top(Frame::Params { node, seen, st: Seq::Item }),
        _ => return None,
    })
}

/// The element schema for index `count` of an array, if another element is allowed.
fn array_item(g: &Grammar, node: NodeId, count: u32) -> Option<NodeId> {
    let Node::Array { prefix, items, max, .. } = &g.nodes[node as usize] else { return None };
    if count >= *max {
        return None;
    }
    prefix.get(count as usize).copied().or(*items)
}

/// Whether an object may still take another key.
fn object_open(g: &Grammar, node: NodeId, seen: u64) -> bool {
    let Node::Object { props, additional, .. } = &g.nodes[node as usize] else { return false };
    additional.is_some() || (0..props.len()).any(|k| seen & (1 << k) == 0)
}

fn object_complete(g: &Grammar, node: NodeId, seen: u64) -> bool {
    let Node::Object { required, .. } = &g.nodes[node as usize] else { return false };
    required & !seen == 0
}

/// String content byte `b` from `sub`: the next sub-state and whether a character completed.
fn str_byte(sub: StrSub, b: u8) -> Option<(StrSub, bool)> {
    match sub {
        StrSub::Plain => match b {
            0x00..=0x1f | b'"' => None,
            b'\\' => Some((StrSub::Esc, false)),
            0x20..=0x7f => Some((StrSub::Plain, true)),
            0xc2..=0xdf => Some((StrSub::Utf8 { need: 1, lo: 0x80, hi: 0xbf }, false)),
            0xe0 => Some((StrSub::Utf8 { need: 2, lo: 0xa0, hi: 0xbf }, false)),
            0xed => Some((StrSub::Utf8 { need: 2, lo: 0x80, hi: 0x9f }, false)),
            0xe1..=0xef => Some((StrSub::Utf8 { need: 2, lo: 0x80, hi: 0xbf }, false)),
            0xf0 => Some((StrSub::Utf8 { need: 3, lo: 0x90, hi: 0xbf }, false)),
            0xf1..=0xf3 => Some((StrSub::Utf8 { need: 3, lo: 0x80, hi: 0xbf }, false)),
            0xf4 => Some((StrSub::Utf8 { need: 3, lo: 0x80, hi: 0x8f }, false)),
            _ => None,
        },
        StrSub::Utf8 { need, lo, hi } => {
            if !(lo..=hi).contains(&b) {
                return None;
            }
            if need == 1 { Some((StrSub::Plain, true)) } else { Some((StrSub::Utf8 { need: need - 1, lo: 0x80, hi: 0xbf }, false)) }
        }
        StrSub::Esc => match b {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some((StrSub::Plain, true)),
            b'u' => Some((StrSub::Hex { left: 4, first: 16, low: false, high: false }, false)),
            _ => None,
        },
        StrSub::PairEsc => (b == b'\\').then_some((StrSub::PairU, false)),
        StrSub::PairU => (b == b'u').then_some((StrSub::Hex { left: 4, first: 16, low: true, high: false }, false)),
        StrSub::Hex { left, first, low, high } => {
            let v = (b as char).to_digit(16)? as u8;
            // Surrogates (D800-DFFF) only as a high-low pair, which is one character: a lone
            // half is valid JSON syntax that strict parsers (serde_json, pydantic's) refuse.
            let (first, high) = match left {
                4 if low && v != 0xd => return None,
                4 => (v, false),
                3 if first == 0xd && low => {
                    if v < 0xc {
                        return None;
                    }
                    (first, false)
                }
                3 if first == 0xd && v >= 0xc => return None,
                3 => (first, first == 0xd && v >= 0x8),
                _ => (first, high),
            };
            match left {
                1 if high => Some((StrSub::PairEsc, false)),
                1 => Some((StrSub::Plain, true)),
                _ => Some((StrSub::Hex { left: left - 1, first, low, high }, false)),
            }
        }
    }
}

/// The characters a `\u` escape with `left` hex digits still to come and value `acc` so far can
/// still write (`high`: the high surrogate it completes, or 0), as at most three ranges: the
/// first escape's non-surrogates, and the supplementary characters of a pair.
fn hex_reach(left: u8, acc: u16, high: u16) -> [(u32, u32); 3] {
    const NONE: (u32, u32) = (1, 0);
    let shift = 4 * left as u32;
    let lo = (acc as u32) << shift;
    let hi = lo | ((1u32 << shift) - 1);
    let clip = |a: u32, b: u32| if lo.max(a) <= hi.min(b) { (lo.max(a), hi.min(b)) } else { NONE };
    let pair = |h: u32, l: (u32, u32)| (0x10000 + ((h - 0xd800) << 10) + (l.0 - 0xdc00), 0x10000 + ((h - 0xd800) << 10) + (l.1 - 0xdc00));
    if high != 0 {
        let l = clip(0xdc00, 0xdfff);
        return [if l.0 <= l.1 { pair(high as u32, l) } else { NONE }, NONE, NONE];
    }
    let h = clip(0xd800, 0xdbff);
    let sup = if h.0 <= h.1 { (pair(h.0, (0xdc00, 0xdc00)).0, pair(h.1, (0xdfff, 0xdfff)).1) } else { NONE };
    [clip(0, 0xd7ff), clip(0xe000, 0xffff), sup]
}

/// The characters a partial UTF-8 sequence (`need` more bytes, the next in `lo..=hi`, bits
/// `acc` so far) can still be.
fn utf8_reach(need: u8, lo: u8, hi: u8, acc: u32) -> (u32, u32) {
    let rest = 6 * (need as u32 - 1);
    let base = acc << (6 * need as u32);
    (base | (((lo & 0x3f) as u32) << rest), base | (((hi & 0x3f) as u32) << rest) | ((1u32 << rest) - 1))
}

/// Patterned string content byte `b` from (`ds`, `sub`): the next state, or `None` when no
/// completion of it continues the automaton.
fn pstr_byte(d: &Dfa, ds: u32, sub: PSub, b: u8) -> Option<(u32, PSub)> {
    let char_done = |c: u32| d.next(ds, c).map(|n| (n, PSub::Plain));
    let partial = |sub: PSub, lo: u32, hi: u32| d.any_in(ds, lo, hi).then_some((ds, sub));
    let partial_hex = |sub: PSub, reach: [(u32, u32); 3]| reach.iter().any(|r| r.0 <= r.1 && d.any_in(ds, r.0, r.1)).then_some((ds, sub));
    match sub {
        PSub::Plain => match b {
            0x00..=0x1f | b'"' => None,
            b'\\' => partial(PSub::Esc, 0, MAX_CHAR),
            0x20..=0x7f => char_done(b as u32),
            // A UTF-8 lead byte: the plain string's table says which (the payload bits are the
            // low 6 - need bits).
            _ => match str_byte(StrSub::Plain, b)? {
                (StrSub::Utf8 { need, lo, hi }, _) => {
                    let acc = (b & (0x3f >> need)) as u32;
                    let (rlo, rhi) = utf8_reach(need, lo, hi, acc);
                    partial(PSub::Utf8 { need, lo, hi, acc }, rlo, rhi)
                }
                _ => None,
            },
        },
        PSub::Utf8 { need, lo, hi, acc } => {
            if !(lo..=hi).contains(&b) {
                return None;
            }
            let acc = (acc << 6) | (b & 0x3f) as u32;
            if need == 1 {
                return char_done(acc);
            }
            let (rlo, rhi) = utf8_reach(need - 1, 0x80, 0xbf, acc);
            partial(PSub::Utf8 { need: need - 1, lo: 0x80, hi: 0xbf, acc }, rlo, rhi)
        }
        PSub::Esc => match b {
            b'"' => char_done(0x22),
            b'\\' => char_done(0x5c),
            b'/' => char_done(0x2f),
            b'b' => char_done(0x08),
            b'f' => char_done(0x0c),
            b'n' => char_done(0x0a),
            b'r' => char_done(0x0d),
            b't' => char_done(0x09),
            b'u' => partial_hex(PSub::Hex { left: 4, acc: 0, high: 0 }, hex_reach(4, 0, 0)),
            _ => None,
        },
        PSub::PairEsc { high } => (b == b'\\').then_some((ds, PSub::PairU { high })),
        PSub::PairU { high } => (b == b'u').then_some((ds, PSub::Hex { left: 4, acc: 0, high })),
        PSub::Hex { left, acc, high } => {
            let v = (b as char).to_digit(16)? as u16;
            let (left, acc) = (left - 1, (acc << 4) | v);
            if left > 0 {
                return partial_hex(PSub::Hex { left, acc, high }, hex_reach(left, acc, high));
            }
            match (high, acc) {
                (0, 0xd800..=0xdbff) => {
                    let base = 0x10000 + (((acc - 0xd800) as u32) << 10);
                    d.any_in(ds, base, base + 0x3ff).then_some((ds, PSub::PairEsc { high: acc }))
                }
                (0, 0xdc00..=0xdfff) => None,
                (0, c) => char_done(c as u32),
                (h, 0xdc00..=0xdfff) => char_done(0x10000 + (((h - 0xd800) as u32) << 10) + (acc - 0xdc00) as u32),
                _ => None,
            }
        }
    }
}

/// The bounds of integer node `node`.
fn int_range(g: &Grammar, node: NodeId) -> (i64, i64) {
    match g.nodes[node as usize] {
        Node::Int { lo, hi } => (lo, hi),
        _ => (i64::MIN, i64::MAX),
    }
}

/// Whether an integer written so far as (`neg`, digits' value `v`, `k` digits; `k == 0`: only
/// the sign) can still end in `lo..=hi` with more digits or none.
fn int_feasible(lo: i64, hi: i64, neg: bool, v: u64, k: u8) -> bool {
    // The magnitudes that fit: for a negative number, -hi..=-lo.
    let (mlo, mhi) = if neg { (-(hi as i128), -(lo as i128)) } else { (lo as i128, hi as i128) };
    if mhi < mlo.max(0) {
        return false;
    }
    if k == 0 {
        return true;
    }
    if v == 0 {
        // "0" or "-0": no digit may follow a leading zero.
        return mlo <= 0;
    }
    // v followed by j more digits: v·10^j ..= v·10^j + 10^j - 1, at most 19 digits in all.
    let mut p: i128 = 1;
    for _ in k..=19 {
        let a = v as i128 * p;
        if a > mhi {
            return false;
        }
        if a + p > mlo {
            return true;
        }
        p *= 10;
    }
    false
}

/// Whether the integer written so far is a whole one within its node's bounds.
fn int_ends(g: &Grammar, node: NodeId, neg: bool, v: u64, k: u8) -> bool {
    let (lo, hi) = int_range(g, node);
    let x = if neg { -(v as i128) } else { v as i128 };
    k >= 1 && lo as i128 <= x && x <= hi as i128
}

/// The bounds of decimal node `node`, in units of 10^-[`DEC_DIGITS`].
fn dec_range(g: &Grammar, node: NodeId) -> (i128, i128) {
    match g.nodes[node as usize] {
        Node::Decimal { lo, hi } => (lo, hi),
        _ => (i128::MIN, i128::MAX),
    }
}

/// 10^e.
fn p10(e: u32) -> i128 {
    10i128.pow(e)
}

/// Whether a bounded number written so far (see `Frame::Dec`; `ki == 0`: only the sign) can
/// still end in `lo..=hi` (units of 10^-15) with at most [`DEC_DIGITS`] digits in all.
fn dec_feasible(lo: i128, hi: i128, neg: bool, point: bool, ki: u8, kf: u8, m: u64) -> bool {
    let d = DEC_DIGITS as u32;
    // The magnitudes that fit: for a negative number, -hi..=-lo.
    let (mlo, mhi) = if neg { (hi.saturating_neg(), lo.saturating_neg()) } else { (lo, hi) };
    let mlo = mlo.max(0);
    if mhi < mlo {
        return false;
    }
    // Some multiple of `step` in [a, b) (a is one) within [mlo, mhi].
    let fits = |a: i128, b: i128, step: i128| {
        let x = if mlo > a { a + (mlo - a + step - 1) / step * step } else { a };
        x < b && x <= mhi
    };
    let (ki, kf) = (ki as u32, kf as u32);
    let left = d - ki - kf;
    if ki == 0 {
        return (0..10).any(|digit| dec_feasible(lo, hi, neg, false, 1, 0, digit));
    }
    let unit = p10(d);
    if point {
        // m / 10^kf and any digits after it (at least one after a bare point).
        if kf == 0 && left == 0 {
            return false;
        }
        let a = m as i128 * p10(d - kf);
        return fits(a, a + p10(d - kf), p10(ki));
    }
    if m == 0 {
        // A leading zero: 0, or 0 and a fraction.
        return fits(0, unit, p10(ki));
    }
    // m and j more integer digits, then a fraction of what digits are left.
    (0..=left).any(|j| {
        let a = m as i128 * p10(j) * unit;
        a <= mhi && fits(a, a + p10(j) * unit, p10(ki + j))
    })
}

/// Whether the bounded number written so far is a whole one within its node's bounds.
fn dec_ends(g: &Grammar, node: NodeId, neg: bool, point: bool, ki: u8, kf: u8, m: u64) -> bool {
    if ki == 0 || (point && kf == 0) {
        return false;
    }
    let (lo, hi) = dec_range(g, node);
    let mag = m as i128 * p10(DEC_DIGITS as u32 - kf as u32);
    let x = if neg { -mag } else { mag };
    lo <= x && x <= hi
}

/// Bytes still needed after a number state before it can end.
fn num_need(st: NumSt) -> u8 {
    if st.accepting() { 0 } else { 1 }
}

fn num_byte(st: NumSt, b: u8) -> Option<NumSt> {
    use NumSt::*;
    Some(match (st, b) {
        (Minus, b'0') => Zero,
        (Minus, b'1'..=b'9') => Int,
        (Int, b'0'..=b'9') => Int,
        (Zero | Int, b'.') => FracStart,
        (Zero | Int | Frac, b'e' | b'E') => ExpStart,
        (FracStart | Frac, b'0'..=b'9') => Frac,
        (ExpStart, b'+' | b'-') => ExpSign,
        (ExpStart | ExpSign, b'0'..=b'9') => Exp,
        (Exp, b'0'..=b'9') => Exp2,
        _ => return None,
    })
}

/// Enters a value of `node` with its first byte `b` (the thread's top is the `Value` frame).
fn enter(g: &Grammar, t: &Thread, node: NodeId, b: u8, out: &mut Vec<Thread>) {
    match &g.nodes[node as usize] {
        Node::AnyOf(alts) => {
            for &a in alts {
                enter(g, t, a, b, out);
            }
        }
        Node::Lit(trie) => {
            if let Some(at) = g.lits[*trie as usize].next(0, b) {
                out.push(t.with_top(Frame::Lit { trie: *trie, at }));
            }
        }
        Node::Number => {
            let st = match b {
                b'-' => NumSt::Minus,
                b'0' => NumSt::Zero,
                b'1'..=b'9' => NumSt::Int,
                _ => return,
            };
            out.push(t.with_top(Frame::Num { st, len: 1 }));
        }
        Node::Int { lo, hi } => {
            let (neg, v, k) = match b {
                b'-' => (true, 0, 0),
                b'0'..=b'9' => (false, (b - b'0') as u64, 1),
                _ => return,
            };
            if int_feasible(*lo, *hi, neg, v, k) {
                out.push(t.with_top(Frame::Int { node, neg, v, k }));
            }
        }
        Node::Decimal { lo, hi } => {
            let (neg, ki, m) = match b {
                b'-' => (true, 0, 0),
                b'0'..=b'9' => (false, 1, (b - b'0') as u64),
                _ => return,
            };
            if dec_feasible(*lo, *hi, neg, false, ki, 0, m) {
                out.push(t.with_top(Frame::Dec { node, neg, point: false, ki, kf: 0, m }));
            }
        }
        Node::String { min, max } => {
            if b == b'"' {
                out.push(t.with_top(Frame::Str { min: *min, max: *max, chars: 0, sub: StrSub::Plain }));
            }
        }
        Node::Pattern(dfa) => {
            if b == b'"' {
                out.push(t.with_top(Frame::PStr { dfa: *dfa, ds: Dfa::START, sub: PSub::Plain }));
            }
        }
        Node::Array { .. } => {
            if b == b'[' {
                out.push(t.with_top(Frame::Arr { node, count: 0, st: Seq::Open }));
            }
        }
        Node::Object { banned, .. } => {
            // Properties that can never be written count as written.
            if b == b'{' {
                out.push(t.with_top(Frame::Obj { node, seen: *banned, st: Seq::Open, cur: NO_KEY }));
            }
        }
        Node::Chain { items, .. } => {
            if let Some(&first) = items.first() {
                let child = t.push(Frame::Chain { node, i: 0 }, Frame::Tight { node: first });
                enter(g, &child, first, b, out);
            }
        }
        Node::Raw(close) => step_thread(g, &t.with_top(Frame::Raw { close: *close, k: 0 }), b, out),
        Node::RawPattern(dfa) => raw_pattern_byte(g, t, *dfa, Dfa::START, PSub::Plain, b, out),
        Node::Calls { .. } => step_thread(g, &t.with_top(Frame::Calls { node, count: 0, st: Seq::Open }), b, out),
        Node::Params { .. } => step_thread(g, &t.with_top(Frame::Params { node, seen: 0, st: Seq::Open }), b, out),
    }
}

/// One byte of patterned raw text in automaton state `ds` (the thread's top is the text or the
/// value before it): the text goes on where the automaton takes the byte (raw UTF-8, no
/// escapes), and ends before it where the automaton accepts (the parent then takes the byte).
fn raw_pattern_byte(g: &Grammar, t: &Thread, dfa: u32, ds: u32, sub: PSub, b: u8, out: &mut Vec<Thread>) {
    let d = &g.dfas[dfa as usize];
    if sub == PSub::Plain
        && d.accepts(ds)
        && let Some(p) = t.pop(g, None)
    {
        step_thread(g, &p, b, out);
    }
    if let Some((ds, sub)) = raw_text_byte(d, ds, sub, b) {
        out.push(t.with_top(Frame::RawPStr { dfa, ds, sub }));
    }
}

/// Byte `b` of patterned raw text from (`ds`, `sub`), staying inside the text: raw UTF-8, no
/// escapes (the one definition the matcher and the masks' fast path share).
fn raw_text_byte(d: &Dfa, ds: u32, sub: PSub, b: u8) -> Option<(u32, PSub)> {
    match sub {
        PSub::Plain if b < 0x80 => d.next(ds, b as u32).map(|n| (n, PSub::Plain)),
        // A UTF-8 lead or continuation byte, as inside a JSON string.
        PSub::Plain | PSub::Utf8 { .. } => pstr_byte(d, ds, sub, b),
        _ => None,
    }
}

/// Starts a tag among `allow` of trie `trie` with its first byte (the thread's top becomes
/// the tag's parent, `parent`).
fn start_tag(g: &Grammar, t: &Thread, parent: Frame, trie: u32, allow: u64, b: u8, out: &mut Vec<Thread>) {
    if allow != 0 {
        let child = t.push(parent, Frame::Tag { trie, at: 0, allow });
        step_thread(g, &child, b, out);
    }
}

fn ws_step(t: &Thread, out: &mut Vec<Thread>) {
    if t.ws < MAX_WS {
        let mut n = t.clone();
        n.ws += 1;
        out.push(n);
    }
}

fn step_thread(g: &Grammar, t: &Thread, b: u8, out: &mut Vec<Thread>) {
    match t.top {
        Frame::Value { node } => {
            if is_ws(b) {
                ws_step(t, out);
            } else {
                enter(g, t, node, b, out);
            }
        }
        Frame::End => {
            if is_ws(b) {
                ws_step(t, out);
            }
        }
        Frame::Tight { node } => enter(g, t, node, b, out),
        Frame::Chain { node, i } => {
            // Only an ended chain is ever on top: it ends where the next byte is its parent's.
            if i as usize == chain_len(g, node)
                && let Some(p) = t.pop(g, None)
            {
                step_thread(g, &p, b, out);
            }
        }
        Frame::Raw { close, k } => {
            let tag = &g.texts[close as usize];
            if b == tag[k as usize] {
                if k as usize + 1 == tag.len() {
                    if let Some(p) = t.pop(g, None) {
                        out.push(p);
                    }
                } else {
                    out.push(t.with_top(Frame::Raw { close, k: k + 1 }));
                }
            } else {
                // The tag's first byte appears nowhere else in it, so a mismatch restarts here.
                let k = u32::from(b == tag[0]);
                out.push(t.with_top(Frame::Raw { close, k }));
            }
        }
        Frame::Tag { trie, at, allow } => {
            let tr = &g.tags[trie as usize];
            if let Some(n) = tr.next(at, b).filter(|&n| tr.nodes[n as usize].below & allow != 0) {
                match tr.nodes[n as usize].end {
                    Some(e) if tr.nodes[n as usize].edges.is_empty() => {
                        if let Some(p) = t.pop(g, Some(e)) {
                            out.push(p);
                        }
                    }
                    _ => out.push(t.with_top(Frame::Tag { trie, at: n, allow })),
                }
            }
        }
        Frame::Name { owner, at, free, quote, len } => name_byte(g, t, owner, at, free, quote, len, b, out),
        Frame::Calls { node, count, st } => {
            let Node::Calls { tags, max, .. } = &g.nodes[node as usize] else { return };
            match st {
                Seq::Open | Seq::Item if is_ws(b) => ws_step(t, out),
                Seq::Open | Seq::Item => {
                    let allow = u64::from(count < *max) | (u64::from(count >= 1) << 1);
                    start_tag(g, t, Frame::Calls { node, count, st: Seq::Tag }, *tags, allow, b, out);
                }
                _ => {}
            }
        }
        Frame::Params { node, seen, st } => {
            let Node::Params { tags, values, required, free, .. } = &g.nodes[node as usize] else { return };
            match st {
                Seq::Open | Seq::Item if is_ws(b) => ws_step(t, out),
                Seq::Open | Seq::Item => {
                    let more = free.is_some() || (0..values.len()).any(|k| seen & (1 << k) == 0);
                    let allow = u64::from(more) | (u64::from(required & !seen == 0) << 1);
                    start_tag(g, t, Frame::Params { node, seen, st: Seq::Tag }, *tags, allow, b, out);
                }
                _ => {}
            }
        }
        Frame::Lit { trie, at } => {
            let tr = &g.lits[trie as usize];
            if let Some(n) = tr.next(at, b) {
                out.push(t.with_top(Frame::Lit { trie, at: n }));
            }
            if tr.nodes[at as usize].end.is_some()
                && let Some(p) = t.pop(g, None)
            {
                step_thread(g, &p, b, out);
            }
        }
        Frame::Num { st, len } => {
            if let Some(n) = num_byte(st, b)
                && len + 1 + num_need(n) <= MAX_NUMBER
            {
                out.push(t.with_top(Frame::Num { st: n, len: len + 1 }));
            }
            if st.accepting()
                && let Some(p) = t.pop(g, None)
            {
                step_thread(g, &p, b, out);
            }
        }
        Frame::Int { node, neg, v, k } => {
            if b.is_ascii_digit() && !(k >= 1 && v == 0) && k < 19 {
                let (lo, hi) = int_range(g, node);
                let (v2, k2) = (v * 10 + (b - b'0') as u64, k + 1);
                if int_feasible(lo, hi, neg, v2, k2) {
                    out.push(t.with_top(Frame::Int { node, neg, v: v2, k: k2 }));
                }
            }
            if int_ends(g, node, neg, v, k)
                && let Some(p) = t.pop(g, None)
            {
                step_thread(g, &p, b, out);
            }
        }
        Frame::Dec { node, neg, point, ki, kf, m } => {
            let (lo, hi) = dec_range(g, node);
            let next = match b {
                // No digit after a leading zero; at most DEC_DIGITS digits.
                b'0'..=b'9' if ki + kf < DEC_DIGITS && (point || ki == 0 || m != 0) => {
                    let m2 = m * 10 + (b - b'0') as u64;
                    Some(if point { (true, ki, kf + 1, m2) } else { (false, ki + 1, 0, m2) })
                }
                b'.' if !point && ki >= 1 => Some((true, ki, 0, m)),
                _ => None,
            };
            if let Some((point, ki, kf, m)) = next
                && dec_feasible(lo, hi, neg, point, ki, kf, m)
            {
                out.push(t.with_top(Frame::Dec { node, neg, point, ki, kf, m }));
            }
            if dec_ends(g, node, neg, point, ki, kf, m)
                && let Some(p) = t.pop(g, None)
            {
                step_thread(g, &p, b, out);
            }
        }
        Frame::Str { min, max, chars, sub } => {
            let bounded = min > 0 || max != UNBOUNDED;
            if sub == StrSub::Plain && b == b'"' {
                if chars >= min
                    && let Some(p) = t.pop(g, None)
                {
                    out.push(p);
                }
                return;
            }
            // A new character may only start below the maximum.
            if sub == StrSub::Plain && bounded && chars >= max {
                return;
            }
            if let Some((sub, done)) = str_byte(sub, b) {
                let chars = if bounded && done { chars + 1 } else { chars };
                out.push(t.with_top(Frame::Str { min, max, chars, sub }));
            }
        }
        Frame::PStr { dfa, ds, sub } => match pstr_step(&g.dfas[dfa as usize], ds, sub, b) {
            PatStep::In(ds, sub) => out.push(t.with_top(Frame::PStr { dfa, ds, sub })),
            PatStep::Close => {
                if let Some(p) = t.pop(g, None) {
                    out.push(p);
                }
            }
            PatStep::Dead => {}
        },
        Frame::RawPStr { dfa, ds, sub } => raw_pattern_byte(g, t, dfa, ds, sub, b, out),
        Frame::Key { obj, at, free, sub } => key_byte(g, t, obj, at, free, sub, b, out),
        Frame::Arr { node, count, st } => {
            let min = match &g.nodes[node as usize] {
                Node::Array { min, .. } => *min,
                _ => return,
            };
            match (st, b) {
                (Seq::Open | Seq::Item | Seq::Comma, _) if is_ws(b) => ws_step(t, out),
                (Seq::Open | Seq::Item, b']') if count >= min => {
                    if let Some(p) = t.pop(g, None) {
                        out.push(p);
                    }
                }
                (Seq::Item, b',') if array_item(g, node, count).is_some() => {
                    out.push(t.with_top(Frame::Arr { node, count, st: Seq::Comma }));
                }
                (Seq::Open | Seq::Comma, _) => {
                    if let Some(item) = array_item(g, node, count) {
                        let child = t.push(Frame::Arr { node, count, st: Seq::Child }, Frame::Value { node: item });
                        enter(g, &child, item, b, out);
                    }
                }
                _ => {}
            }
        }
        Frame::Obj { node, seen, st, cur } => match (st, b) {
            (Seq::Open | Seq::Colon | Seq::Item | Seq::Comma, _) if is_ws(b) => ws_step(t, out),
            (Seq::Open | Seq::Item, b'}') if object_complete(g, node, seen) => {
                if let Some(p) = t.pop(g, None) {
                    out.push(p);
                }
            }
            (Seq::Item, b',') if object_open(g, node, seen) => {
                out.push(t.with_top(Frame::Obj { node, seen, st: Seq::Comma, cur: NO_KEY }));
            }
            (Seq::Open | Seq::Comma, b'"') if object_open(g, node, seen) => {
                let free = matches!(&g.nodes[node as usize], Node::Object { additional: Some(_), .. });
                out.push(t.push(Frame::Obj { node, seen, st: Seq::Child, cur: NO_KEY }, Frame::Key { obj: node, at: 0, free, sub: StrSub::Plain }));
            }
            (Seq::Colon, b':') => {
                let Node::Object { props, additional, .. } = &g.nodes[node as usize] else { return };
                let value = if cur == NO_KEY { additional.expect("an additional key was allowed") } else { props[cur as usize] };
                out.push(t.push(Frame::Obj { node, seen, st: Seq::Child, cur }, Frame::Value { node: value }));
            }
            _ => {}
        },
    }
}

/// One byte of an object key.
#[allow(clippy::too_many_arguments)]
fn key_byte(g: &Grammar, t: &Thread, obj: NodeId, at: u32, free: bool, sub: StrSub, b: u8, out: &mut Vec<Thread>) {
    let Node::Object { keys, .. } = &g.nodes[obj as usize] else { return };
    let trie = &g.keys[*keys as usize];
    let seen = match t.below.as_ref().map(|l| l.frame) {
        Some(Frame::Obj { seen, .. }) => seen,
        _ => return,
    };
    if sub == StrSub::Plain && b == b'"' {
        // The key ends: a declared key not written yet, or (when allowed) any other key.
        let declared = (at != NO_KEY).then(|| trie.nodes[at as usize].end).flatten();
        let key = match declared {
            Some(k) if seen & (1 << k) == 0 => k,
            Some(_) => return,
            None if free => NO_KEY,
            None => return,
        };
        if let Some(p) = t.pop(g, Some(key)) {
            out.push(p);
        }
        return;
    }
    let Some((nsub, _)) = str_byte(sub, b) else { return };
    // The declared-key trie follows the bytes as a JSON encoder writes the keys (escapes
    // included). Escapes only along it: another spelling of a declared key (`\u0061` for
    // `a`) would otherwise pass as an additional key.
    let Some(nat) = follow_name(trie, at, b, free, seen) else { return };
    let escaping = !matches!(sub, StrSub::Plain | StrSub::Utf8 { .. }) || b == b'\\';
    if escaping && nat == NO_KEY {
        return;
    }
    out.push(t.with_top(Frame::Key { obj, at: nat, free, sub: nsub }));
}

/// The declared-name trie position after byte `b` of a key or name (`NO_KEY` once off every
/// declared name), or `None` when the name can no longer be valid. Without other names
/// allowed (`free`), only towards names not written yet (`seen`); with them, it follows every
/// declared name, so one written again is caught at its closing quote.
fn follow_name(trie: &ByteTrie, at: u32, b: u8, free: bool, seen: u64) -> Option<u32> {
    let next = if at == NO_KEY { None } else { trie.next(at, b) };
    let nat = match next {
        Some(n) if free || trie.nodes[n as usize].below & !seen != 0 => n,
        _ => NO_KEY,
    };
    (nat != NO_KEY || free).then_some(nat)
}

/// One byte of a tool or parameter name (`NAME">`).
#[allow(clippy::too_many_arguments)]
fn name_byte(g: &Grammar, t: &Thread, owner: NodeId, at: u32, free: bool, quote: bool, len: u16, b: u8, out: &mut Vec<Thread>) {
    if quote {
        if b == b'>'
            && let Some(p) = t.pop(g, Some(at))
        {
            out.push(p);
        }
        return;
    }
    let (trie, seen) = match &g.nodes[owner as usize] {
        Node::Calls { names, .. } => (&g.keys[*names as usize], 0u64),
        Node::Params { keys, .. } => {
            let seen = match t.below.as_ref().map(|l| l.frame) {
                Some(Frame::Params { seen, .. }) => seen,
                _ => return,
            };
            (&g.keys[*keys as usize], seen)
        }
        _ => return,
    };
    if b == b'"' {
        let declared = (at != NO_KEY).then(|| trie.nodes[at as usize].end).flatten();
        let key = match declared {
            Some(k) if seen & (1 << k) == 0 => k,
            Some(_) => return,
            None if free && len > 0 => NO_KEY,
            None => return,
        };
        out.push(t.with_top(Frame::Name { owner, at: key, free, quote: true, len }));
        return;
    }
    if matches!(b, b'<' | b'>' | b'\n') || len >= MAX_NAME {
        return;
    }
    let Some(nat) = follow_name(trie, at, b, free, seen) else { return };
    out.push(t.with_top(Frame::Name { owner, at: nat, free, quote: false, len: len + 1 }));
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// Whether `text` is a whole document of `g`.
    pub(crate) fn accepts(g: &Grammar, text: &str) -> bool {
        let mut s = State::start(g);
        s.feed(g, text.as_bytes()) && s.can_end(g)
    }

    /// Whether `text` starts a document of `g`.
    pub(crate) fn prefix_ok(g: &Grammar, text: &str) -> bool {
        let mut s = State::start(g);
        s.feed(g, text.as_bytes())
    }

    #[test]
    fn any_object_takes_json_objects_only() {
        let g = Grammar::any_object();
        for ok in [r#"{}"#, r#"{"a": [1, -2.5e3, "x\u00e9\n", true, null, {"b": {}}]}"#, " {\"k\":\"é\"} \n"] {
            assert!(accepts(&g, ok), "{ok}");
        }
        for bad in ["[]", "{", r#"{"a" 1}"#, r#"{"a":01}"#, r#"{"a":1,}"#, "{\"a\":\"\x01\"}", r#"{"a":"\x"}"#, "{} x", r#"{"a":tru}"#] {
            assert!(!accepts(&g, bad), "{bad}");
        }
        // Invalid UTF-8 inside strings is refused byte by byte.
        let mut s = State::start(&g);
        assert!(s.feed(&g, b"{\"a\":\""));
        assert!(s.step(&g, 0xc0).is_dead());
        assert!(s.step(&g, 0xed).step(&g, 0xa0).is_dead(), "a UTF-16 surrogate in UTF-8");
        assert!(!s.step(&g, 0xe2).step(&g, 0x82).step(&g, 0xac).is_dead(), "the euro sign");
    }

    #[test]
    fn objects_follow_properties_required_and_additional() {
        let g = Grammar::from_schema(&json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 3}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
            "required": ["name", "n"],
            "additionalProperties": false
        }))
        .unwrap();
        assert!(accepts(&g, r#"{"name":"abc","n":-12}"#));
        assert!(accepts(&g, r#"{"n":0, "name":"", "tags":["b","a"]}"#));
        assert!(!accepts(&g, r#"{"name":"abcd","n":1}"#), "maxLength");
        assert!(!accepts(&g, r#"{"name":"a"}"#), "required n");
        assert!(!accepts(&g, r#"{"name":"a","n":1.5}"#), "integer");
        assert!(!accepts(&g, r#"{"name":"a","n":1,"x":1}"#), "no additional properties");
        assert!(!accepts(&g, r#"{"name":"a","name":"b","n":1}"#), "no duplicate keys");
        assert!(!accepts(&g, r#"{"name":"a","n":1,"tags":["a","b","a"]}"#), "maxItems");
        assert!(!accepts(&g, r#"{"name":"a","n":1,"tags":["c"]}"#), "enum");
        // A key already written cannot even be started again.
        assert!(!prefix_ok(&g, r#"{"name":"a","na"#));
        assert!(prefix_ok(&g, r#"{"name":"a","n"#));
    }

    #[test]
    fn additional_keys_may_not_shadow_declared_ones() {
        let g = Grammar::from_schema(&json!({"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}})).unwrap();
        assert!(accepts(&g, r#"{"a": 1, "ab": "x", "b": "y"}"#));
        assert!(!accepts(&g, r#"{"a": "x"}"#), "declared a is an integer");
        assert!(!accepts(&g, r#"{"ab": 1}"#), "additional keys are strings");
        assert!(!accepts(&g, r#"{"a": 1, "a": 2}"#));
        assert!(!accepts(&g, r#"{"a": 1, "a": "x"}"#), "a declared key written again is not an additional one");
    }

    #[test]
    fn any_of_refs_and_literals() {
        let g = Grammar::from_schema(&json!({
            "$defs": {"node": {"type": "object", "properties": {"v": {"const": 12}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"], "additionalProperties": false}},
            "$ref": "#/$defs/node"
        }))
        .unwrap();
        assert!(accepts(&g, r#"{"v":12,"next":{"v":12,"next":null}}"#));
        assert!(!accepts(&g, r#"{"v":1,"next":null}"#));
        assert!(!accepts(&g, r#"{"v":123,"next":null}"#));
        let g = Grammar::from_schema(&json!({"enum": [1, 12, "x", null, {"a": [true]}]})).unwrap();
        for ok in ["1", "12", "\"x\"", "null", "{\"a\":[true]}", " 12 "] {
            assert!(accepts(&g, ok), "{ok}");
        }
        assert!(!accepts(&g, "2") && !accepts(&g, "{\"a\": [true]}"), "enum members are written compactly");
    }

    #[test]
    fn numbers_and_whitespace_are_bounded() {
        let g = Grammar::from_schema(&json!({"type": "number"})).unwrap();
        assert!(accepts(&g, "-0.5e+10"));
        assert!(!accepts(&g, "1e308"), "three exponent digits");
        assert!(!accepts(&g, "1."));
        assert!(accepts(&g, &"9".repeat(MAX_NUMBER as usize)));
        assert!(!prefix_ok(&g, &"9".repeat(MAX_NUMBER as usize + 1)));
        // A state one byte short of the bound may not start an exponent it cannot finish.
        let mut s = State::start(&g);
        assert!(s.feed(&g, "9".repeat(MAX_NUMBER as usize - 1).as_bytes()));
        assert!(s.step(&g, b'e').is_dead());
        assert!(accepts(&g, &format!("{}1", " ".repeat(MAX_WS as usize))));
        assert!(!prefix_ok(&g, &" ".repeat(MAX_WS as usize + 1)));
    }

    #[test]
    fn strings_count_characters_not_bytes() {
        let g = Grammar::from_schema(&json!({"type": "string", "minLength": 2, "maxLength": 2})).unwrap();
        assert!(accepts(&g, "\"éa\""));
        assert!(accepts(&g, r#""\n\u0041""#));
        assert!(!accepts(&g, "\"a\""));
        assert!(!accepts(&g, "\"abc\""));
    }
}

#[cfg(test)]
pub(crate) mod tool_tests {
    use super::*;
    use crate::constrain::schema::{CallTags, CallTool};
    use serde_json::json;

    pub(crate) const TAGS: CallTags<'static> = CallTags {
        invoke_open: "<invoke name=\"",
        invoke_close: "</invoke>",
        param_open: "<parameter name=\"",
        param_close: "</parameter>",
        block_close: "</minimax:tool_call>",
    };

    fn grammar(max: u32) -> Grammar {
        let weather = json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
            "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": false}
        }, "required": ["city"]});
        let free = json!({"type": "object"});
        let none = json!({"type": "object", "properties": {}, "additionalProperties": false});
        Grammar::tool_calls(
            &[CallTool { name: "get_weather", parameters: &weather }, CallTool { name: "anything", parameters: &free }, CallTool { name: "ping", parameters: &none }],
            TAGS,
            max,
        )
        .unwrap()
    }

    fn accepts(g: &Grammar, text: &str) -> bool {
        let mut s = State::start(g);
        s.feed(g, text.as_bytes()) && s.at_end()
    }

    #[test]
    fn tool_blocks_follow_the_tools() {
        let g = grammar(8);
        let ok = [
            "\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris <b>!</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>",
            "<invoke name=\"get_weather\"><parameter name=\"unit\">f</parameter><parameter name=\"city\"></parameter><parameter name=\"opts\"> {\"x\": true} </parameter></invoke></minimax:tool_call>",
            "<invoke name=\"anything\"><parameter name=\"q\">1</parameter><parameter name=\"r\">x</parameter></invoke><invoke name=\"ping\"></invoke></minimax:tool_call>",
        ];
        for t in ok {
            assert!(accepts(&g, t), "{t}");
        }
        let bad = [
            ("</minimax:tool_call>", "no invoke"),
            ("<invoke name=\"get_weathe\">", "unknown tool"),
            ("<invoke name=\"get_weather\"></invoke>", "city is required"),
            ("<invoke name=\"get_weather\"><parameter name=\"town\">", "undeclared parameter"),
            ("<invoke name=\"get_weather\"><parameter name=\"city\">a</parameter><parameter name=\"city\">", "twice"),
            ("<invoke name=\"get_weather\"><parameter name=\"days\">3.5<", "an integer"),
            ("<invoke name=\"get_weather\"><parameter name=\"unit\"> c", "enum values verbatim, no space"),
            ("<invoke name=\"get_weather\"><parameter name=\"unit\">k", "enum"),
            ("<invoke name=\"ping\"><parameter name=\"", "ping takes no parameters"),
            ("<invoke name=\"ping\"></invoke>x", "text inside the block"),
        ];
        for (t, why) in bad {
            let mut s = State::start(&g);
            assert!(!s.feed(&g, t.as_bytes()) || !s.at_end() && t.ends_with("</minimax:tool_call>"), "{why}: {t}");
        }
        // One invoke a block when calls may not run in parallel.
        let one = grammar(1);
        assert!(accepts(&one, "<invoke name=\"ping\"></invoke></minimax:tool_call>"));
        let mut s = State::start(&one);
        assert!(!s.feed(&one, b"<invoke name=\"ping\"></invoke><invoke"));
    }

    /// A string parameter's `pattern` / `format` holds its raw text (no JSON quotes or escapes:
    /// the template writes strings verbatim), which ends where the automaton accepts and the
    /// closing tag begins; the text may hold `<`, never the closing tag.
    #[test]
    fn patterned_string_parameters_hold_their_raw_text() {
        let params = json!({"type": "object", "properties": {
            "day": {"type": "string", "format": "date"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
            "name": {"type": "string", "pattern": "^é\\w*$", "maxLength": 3},
            "tag": {"type": "string", "pattern": "^<b>$"},
            "any": {"type": "string", "pattern": "^.*$"}
        }, "required": ["day"]});
        let g = Grammar::tool_calls(&[CallTool { name: "f", parameters: &params }], TAGS, 1).unwrap();
        let call = |p: &str, v: &str| format!("<invoke name=\"f\"><parameter name=\"day\">2024-02-28</parameter><parameter name=\"{p}\">{v}</parameter></invoke></minimax:tool_call>");
        for (p, v) in [("code", "AB-1"), ("code", "ZZ-999"), ("name", "é"), ("name", "éa_"), ("tag", "<b>"), ("any", "a<b"), ("any", "a \"quoted\" \\ text")] {
            assert!(accepts(&g, &call(p, v)), "{p} = {v:?}");
        }
        for (p, v) in [("code", "AB-1234"), ("code", "ab-1"), ("code", ""), ("name", "éab_"), ("name", "e"), ("tag", "x<y"), ("any", "two\nlines")] {
            assert!(!accepts(&g, &call(p, v)), "{p} = {v:?} must be refused");
        }
        for v in ["2024-13-01", "\"2024-01-01\"", "2024-1-01", ""] {
            let t = format!("<invoke name=\"f\"><parameter name=\"day\">{v}</parameter></invoke></minimax:tool_call>");
            assert!(!accepts(&g, &t), "day = {v:?} must be refused");
        }
        assert!(accepts(&g, "<invoke name=\"f\"><parameter name=\"day\">1999-12-31</parameter></invoke></minimax:tool_call>"));
        // The first byte that leaves the pattern kills the thread at once.
        let mut s = State::start(&g);
        assert!(!s.feed(&g, b"<invoke name=\"f\"><parameter name=\"code\">A1"));
    }
}
