//! String values' `pattern` and `format`: the ECMA-262 regular expressions JSON Schema uses,
//! compiled to a DFA over Unicode scalar values, which the matcher steps once per decoded
//! character of a string (`Frame::PStr`).
//!
//! Supported: literals and escapes (`\n`, `\t`, `\uXXXX`, `\u{X}`, `\xHH`, escaped
//! punctuation), `.`, classes (`[a-z_]`, `[^...]`, `\d \D \w \W \s \S` inside or outside),
//! groups (`(...)`, `(?:...)`, `(?<name>...)`), alternation, the quantifiers `* + ? {n} {n,}
//! {n,m}` (and their lazy forms: the same set of strings), and `^` / `$` at the start / end of
//! a top-level alternative. A pattern matches anywhere in the string unless anchored, as JSON
//! Schema says. Refused (an error the schema compiler puts at the keyword's place):
//! back-references, look-around, `\b` / `\B`, Unicode property escapes, anchors elsewhere, and
//! patterns whose automaton grows past [`MAX_STATES`].

use std::collections::{HashMap, VecDeque};

/// Most DFA states one string's automaton (pattern, format and length bounds together) may have.
pub const MAX_STATES: usize = 20_000;
/// Most NFA states a pattern may expand to (counted repetitions copy their operand).
const MAX_NFA: usize = 50_000;
/// Largest count a `{n,m}` quantifier may use.
const MAX_COUNT: u32 = 1_000;
/// The last Unicode scalar value.
pub const MAX_CHAR: u32 = 0x10_ffff;

/// A deterministic automaton over code points. Every state can reach an accepting one (after
/// [`Dfa::prune`]), so a string the matcher lets through can always be completed.
#[derive(Debug, Clone, PartialEq)]
pub struct Dfa {
    states: Vec<DState>,
}

#[derive(Debug, Clone, PartialEq)]
struct DState {
    accept: bool,
    /// Sorted, disjoint ranges `(lo, hi, next)`, both ends included.
    trans: Vec<(u32, u32, u32)>,
}

impl Dfa {
    /// The start state.
    pub const START: u32 = 0;

    /// The automaton of a JSON Schema `pattern` (matching anywhere unless anchored).
    pub fn from_pattern(pattern: &str) -> Result<Dfa, String> {
        let branches = Parser::new(pattern).top()?;
        let mut nfa = Nfa::default();
        let start = nfa.state();
        let end = nfa.state();
        for (ast, anchored_start, anchored_end) in branches {
            let mut parts = Vec::new();
            if !anchored_start {
                parts.push(any_star());
            }
            parts.push(ast);
            if !anchored_end {
                parts.push(any_star());
            }
            let (s, e) = nfa.build(&Ast::Cat(parts))?;
            nfa.eps(start, s);
            nfa.eps(e, end);
        }
        nfa.determinize(start, end)?.prune().ok_or_else(|| "no string matches this pattern".to_string())
    }

    /// Strings that never hold `tag` (ASCII, its first character nowhere else in it): a raw
    /// tool-call value, which ends at the first closing tag. State `k`: the last `k`
    /// characters are the tag's first `k`.
    pub fn without(tag: &str) -> Dfa {
        let t: Vec<u32> = tag.chars().map(|c| c as u32).collect();
        debug_assert!(!t.is_empty() && !t[1..].contains(&t[0]), "the tag's first character recurs");
        let states = (0..t.len())
            .map(|k| {
                // Characters with their own target, sorted: the tag's next one and its first.
                let mut special: Vec<(u32, Option<u32>)> = vec![(t[0], Some(1))];
                if k > 0 {
                    special.push((t[k], (k + 1 < t.len()).then_some(k as u32 + 1)));
                } else if t.len() == 1 {
                    special[0].1 = None;
                }
                special.sort_unstable();
                let mut trans = Vec::new();
                let mut lo = 0u32;
                for (c, to) in special {
                    if c > lo {
                        trans.push((lo, c - 1, 0));
                    }
                    if let Some(to) = to {
                        trans.push((c, c, to));
                    }
                    lo = c + 1;
                }
                if lo <= MAX_CHAR {
                    trans.push((lo, MAX_CHAR, 0));
                }
                DState { accept: true, trans }
            })
            .collect();
        Dfa { states }
    }

    /// Strings of `min..=max` characters (`max` [`u32::MAX`]: unbounded), any characters.
    pub fn length(min: u32, max: u32) -> Result<Dfa, String> {
        let top = if max == u32::MAX { min } else { max };
        if top as usize >= MAX_STATES {
            return Err(format!("a length bound of {top} is too large beside a pattern or format (at most {})", MAX_STATES - 1));
        }
        let states = (0..=top)
            .map(|i| DState {
                accept: i >= min && i <= max,
                trans: if i < top {
                    vec![(0, MAX_CHAR, i + 1)]
                } else if max == u32::MAX {
                    vec![(0, MAX_CHAR, i)]
                } else {
                    vec![]
                },
            })
            .collect();
        Ok(Dfa { states })
    }

    /// The strings both accept (reachable product states only), pruned; `None`: no string.
    pub fn intersect(&self, other: &Dfa) -> Result<Option<Dfa>, String> {
        let mut ids: HashMap<(u32, u32), u32> = HashMap::new();
        let mut queue = VecDeque::new();
        let mut states = Vec::new();
        ids.insert((0, 0), 0);
        queue.push_back((0u32, 0u32));
        states.push(DState { accept: false, trans: vec![] });
        while let Some((a, b)) = queue.pop_front() {
            let id = ids[&(a, b)] as usize;
            let (sa, sb) = (&self.states[a as usize], &other.states[b as usize]);
            let mut trans = Vec::new();
            let (mut i, mut j) = (0, 0);
            while i < sa.trans.len() && j < sb.trans.len() {
                let (alo, ahi, an) = sa.trans[i];
                let (blo, bhi, bn) = sb.trans[j];
                let (lo, hi) = (alo.max(blo), ahi.min(bhi));
                if lo <= hi {
                    let next = match ids.get(&(an, bn)) {
                        Some(&n) => n,
                        None => {
                            let n = states.len() as u32;
                            if states.len() >= MAX_STATES {
                                return Err(format!("the string's automaton needs more than {MAX_STATES} states (pattern, format and length bounds together)"));
                            }
                            ids.insert((an, bn), n);
                            states.push(DState { accept: false, trans: vec![] });
                            queue.push_back((an, bn));
                            n
                        }
                    };
                    push_range(&mut trans, lo, hi, next);
                }
                if ahi < bhi {
                    i += 1;
                } else {
                    j += 1;
                }
            }
            states[id] = DState { accept: sa.accept && sb.accept, trans };
        }
        Ok(Dfa { states }.prune())
    }

    /// Without the states that cannot reach an accepting one; `None` when the start cannot.
    pub fn prune(self) -> Option<Dfa> {
        let n = self.states.len();
        let mut rev: Vec<Vec<u32>> = vec![Vec::new(); n];
        for (s, st) in self.states.iter().enumerate() {
            for &(_, _, t) in &st.trans {
                rev[t as usize].push(s as u32);
            }
        }
        let mut live = vec![false; n];
        let mut stack: Vec<u32> = (0..n as u32).filter(|&s| self.states[s as usize].accept).collect();
        for &s in &stack {
            live[s as usize] = true;
        }
        while let Some(s) = stack.pop() {
            for &p in &rev[s as usize] {
                if !live[p as usize] {
                    live[p as usize] = true;
                    stack.push(p);
                }
            }
        }
        if !live[0] {
            return None;
        }
        let mut map = vec![u32::MAX; n];
        let mut k = 0;
        for s in 0..n {
            if live[s] {
                map[s] = k;
                k += 1;
            }
        }
        let states = self
            .states
            .into_iter()
            .enumerate()
            .filter(|(s, _)| live[*s])
            .map(|(_, st)| DState {
                accept: st.accept,
                trans: st.trans.into_iter().filter(|t| live[t.2 as usize]).map(|(lo, hi, t)| (lo, hi, map[t as usize])).collect(),
            })
            .collect();
        Some(Dfa { states })
    }

    /// The state after character `c`, or `None` (no string matches with it).
    pub fn next(&self, s: u32, c: u32) -> Option<u32> {
        let t = &self.states[s as usize].trans;
        let i = t.partition_point(|r| r.1 < c);
        t.get(i).filter(|r| r.0 <= c).map(|r| r.2)
    }

    /// Whether the string may end in state `s`.
    pub fn accepts(&self, s: u32) -> bool {
        self.states[s as usize].accept
    }

    /// Whether some character in `lo..=hi` continues from `s`.
    pub fn any_in(&self, s: u32, lo: u32, hi: u32) -> bool {
        let t = &self.states[s as usize].trans;
        let i = t.partition_point(|r| r.1 < lo);
        t.get(i).is_some_and(|r| r.0 <= hi)
    }

    /// Whether it accepts all of `s` (tests).
    #[cfg(test)]
    pub fn matches(&self, s: &str) -> bool {
        let mut st = Self::START;
        for c in s.chars() {
            match self.next(st, c as u32) {
                Some(n) => st = n,
                None => return false,
            }
        }
        self.accepts(st)
    }

    /// How many states it has.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether it has no states (never: a pruned automaton keeps its start).
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }
}

/// Appends a range, merging it with the last one when adjacent with the same target.
fn push_range(trans: &mut Vec<(u32, u32, u32)>, lo: u32, hi: u32, next: u32) {
    if let Some(last) = trans.last_mut()
        && last.2 == next
        && last.1 + 1 == lo
    {
        last.1 = hi;
        return;
    }
    trans.push((lo, hi, next));
}

/// The built-in pattern of a `format` value (anchored), or `None` for formats left as
/// annotations. Each is a strict subset of its format, so a value is valid for any validator
/// (jsonschema's and pydantic's): dates from year 1000 with no 29 February (no leap-year
/// arithmetic), times with an offset and no leap second, upper-case `T` / `Z`; host names of at
/// most three dotted labels of at most 61 characters, no label with `--` (IDNA's reserved
/// form) and none ending in `-`; emails on such a domain with a common top-level domain (never
/// a special-use one such as `.test` or `.local`); URIs as `http(s)`, `ftp` or `ws(s)` with a
/// host whose last label starts with a letter, a port below 65,536, a path and a query.
pub fn format_pattern(format: &str) -> Option<&'static str> {
    Some(match format {
        "date-time" => concat!(
            r"^[1-9][0-9]{3}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))",
            r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
        ),
        "date" => r"^[1-9][0-9]{3}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))$",
        "time" => r"^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
        "uuid" => r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
        "email" => concat!(
            r"^[A-Za-z0-9_%+-]{1,32}(\.[A-Za-z0-9_%+-]{1,32}){0,2}@([A-Za-z0-9]([A-Za-z0-9]|-[A-Za-z0-9]){0,30}\.){1,2}",
            r"(com|org|net|edu|gov|io|dev|ai|app|co|uk|de|fr|jp|cn|in|us|ca|au|nl|es|it|br|ch|se|info|biz|me|tv|xyz)$"
        ),
        "hostname" => r"^[A-Za-z0-9]([A-Za-z0-9]|-[A-Za-z0-9]){0,30}(\.[A-Za-z0-9]([A-Za-z0-9]|-[A-Za-z0-9]){0,30}){0,2}$",
        // pydantic's IPvAnyAddress writes its own format name: IPv4 is a subset of it.
        "ipv4" | "ipvanyaddress" => r"^((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$",
        "uri" => concat!(
            r"^(https?|ftp|wss?)://([A-Za-z0-9]([A-Za-z0-9]|-[A-Za-z0-9]){0,30}\.){0,2}[A-Za-z]([A-Za-z0-9]|-[A-Za-z0-9]){0,30}",
            r"(:([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?",
            r"(/([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})*)*(\?([A-Za-z0-9._~!$&'()*+,;=:@/?-]|%[0-9A-Fa-f]{2})*)?$"
        ),
        _ => return None,
    })
}

// ---- parsing ----

/// A parsed pattern: character sets combined.
#[derive(Debug, Clone)]
enum Ast {
    Set(Vec<(u32, u32)>),
    Cat(Vec<Ast>),
    Alt(Vec<Ast>),
    Rep(Box<Ast>, u32, Option<u32>),
}

fn any_star() -> Ast {
    Ast::Rep(Box::new(Ast::Set(vec![(0, MAX_CHAR)])), 0, None)
}

/// Sorted, merged ranges.
fn normalize(mut r: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    r.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(r.len());
    for (lo, hi) in r {
        match out.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

fn complement(r: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut next = 0u32;
    for &(lo, hi) in r {
        if lo > next {
            out.push((next, lo - 1));
        }
        next = hi.saturating_add(1);
    }
    if next <= MAX_CHAR {
        out.push((next, MAX_CHAR));
    }
    out
}

/// ASCII characters outside `r`.
fn ascii_minus(r: &[(u32, u32)]) -> Vec<(u32, u32)> {
    complement(r).into_iter().filter(|x| x.0 <= 0x7f).map(|(lo, hi)| (lo, hi.min(0x7f))).collect()
}

const DIGIT: &[(u32, u32)] = &[(0x30, 0x39)];
const WORD: &[(u32, u32)] = &[(0x30, 0x39), (0x41, 0x5a), (0x5f, 0x5f), (0x61, 0x7a)];
/// ECMA-262 white space and line terminators.
const SPACE: &[(u32, u32)] = &[
    (0x09, 0x0d),
    (0x20, 0x20),
    (0xa0, 0xa0),
    (0x1680, 0x1680),
    (0x2000, 0x200a),
    (0x2028, 0x2029),
    (0x202f, 0x202f),
    (0x205f, 0x205f),
    (0x3000, 0x3000),
    (0xfeff, 0xfeff),
];
/// What `.` excludes: line terminators.
const LINE_END: &[(u32, u32)] = &[(0x0a, 0x0a), (0x0d, 0x0d), (0x2028, 0x2029)];

struct Parser<'a> {
    chars: Vec<char>,
    at: usize,
    src: &'a str,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Parser { chars: src.chars().collect(), at: 0, src }
    }

    fn err(&self, what: &str) -> String {
        format!("pattern {:?}: {what} (at character {})", self.src, self.at)
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    /// Top-level alternatives, each with whether it is anchored at its start and end.
    fn top(&mut self) -> Result<Vec<(Ast, bool, bool)>, String> {
        let mut out = Vec::new();
        loop {
            let start = self.eat('^');
            let mut items = Vec::new();
            let mut end = false;
            while let Some(c) = self.peek() {
                if c == '|' {
                    break;
                }
                if c == '$' {
                    self.at += 1;
                    if !matches!(self.peek(), None | Some('|')) {
                        return Err(self.err("`$` is supported only at the end of the pattern or of a top-level alternative"));
                    }
                    end = true;
                    break;
                }
                if c == ')' {
                    return Err(self.err("unbalanced `)`"));
                }
                items.push(self.quantified()?);
            }
            out.push((Ast::Cat(items), start, end));
            if !self.eat('|') {
                break;
            }
        }
        Ok(out)
    }

    fn alternation(&mut self) -> Result<Ast, String> {
        let mut alts = Vec::new();
        loop {
            let mut items = Vec::new();
            while let Some(c) = self.peek() {
                if c == '|' || c == ')' {
                    break;
                }
                items.push(self.quantified()?);
            }
            alts.push(Ast::Cat(items));
            if !self.eat('|') {
                break;
            }
        }
        Ok(if alts.len() == 1 { alts.pop().unwrap() } else { Ast::Alt(alts) })
    }

    fn quantified(&mut self) -> Result<Ast, String> {
        let atom = self.atom()?;
        let (min, max) = match self.peek() {
            Some(c @ ('*' | '+' | '?')) => {
                self.at += 1;
                match c {
                    '*' => (0, None),
                    '+' => (1, None),
                    _ => (0, Some(1)),
                }
            }
            Some('{') => match self.counts()? {
                Some(c) => c,
                None => return Ok(atom),
            },
            _ => return Ok(atom),
        };
        // A lazy quantifier matches the same strings.
        self.eat('?');
        let save = self.at;
        if matches!(self.peek(), Some('*' | '+' | '?')) || (self.peek() == Some('{') && self.counts()?.is_some()) {
            self.at = save;
            return Err(self.err("a quantifier cannot follow a quantifier"));
        }
        Ok(Ast::Rep(Box::new(atom), min, max))
    }

    /// `{n}`, `{n,}`, `{n,m}` at `{` (consumed up to its `}`), or `None` (a literal brace: `{` not
    /// followed by a count, as ECMA-262's Annex B reads it).
    fn counts(&mut self) -> Result<Option<(u32, Option<u32>)>, String> {
        let save = self.at;
        self.at += 1;
        let num = |p: &mut Self| -> Option<u32> {
            let s = p.at;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.at += 1;
            }
            (p.at > s).then(|| p.chars[s..p.at].iter().collect::<String>().parse::<u32>().unwrap_or(u32::MAX))
        };
        let Some(min) = num(self) else {
            self.at = save;
            return Ok(None);
        };
        let max = if self.eat(',') { num(self) } else { Some(min) };
        if !self.eat('}') {
            self.at = save;
            return Ok(None);
        }
        if max.is_some_and(|m| m < min) {
            return Err(self.err("a {n,m} quantifier with m < n"));
        }
        if min > MAX_COUNT || max.is_some_and(|m| m > MAX_COUNT) {
            return Err(self.err(&format!("counts above {MAX_COUNT} are not supported")));
        }
        Ok(Some((min, max)))
    }

    fn atom(&mut self) -> Result<Ast, String> {
        let c = self.peek().ok_or_else(|| self.err("unexpected end"))?;
        self.at += 1;
        Ok(match c {
            '.' => Ast::Set(complement(LINE_END)),
            '(' => {
                if self.eat('?') {
                    if self.eat(':') {
                    } else if self.peek() == Some('<') && !matches!(self.chars.get(self.at + 1), Some('=' | '!')) {
                        self.at += 1;
                        while let Some(c) = self.peek() {
                            self.at += 1;
                            if c == '>' {
                                break;
                            }
                        }
                    } else {
                        return Err(self.err("look-around groups are not supported"));
                    }
                }
                let inner = self.alternation()?;
                if !self.eat(')') {
                    return Err(self.err("missing `)`"));
                }
                inner
            }
            '[' => Ast::Set(self.class()?),
            '\\' => Ast::Set(self.escape(false)?),
            '^' | '$' => return Err(self.err("anchors are supported only at the start / end of the pattern or of a top-level alternative")),
            '*' | '+' | '?' => return Err(self.err("nothing to repeat")),
            ')' => return Err(self.err("unbalanced `)`")),
            c => Ast::Set(vec![(c as u32, c as u32)]),
        })
    }

    /// A class after `[`.
    fn class(&mut self) -> Result<Vec<(u32, u32)>, String> {
        let negate = self.eat('^');
        let mut ranges = Vec::new();
        loop {
            let c = self.peek().ok_or_else(|| self.err("missing `]`"))?;
            if c == ']' {
                // (`[]` matches nothing, `[^]` anything.)
                self.at += 1;
                break;
            }
            let lo = self.class_atom()?;
            if self.peek() == Some('-') && self.chars.get(self.at + 1).is_some_and(|&n| n != ']') {
                self.at += 1;
                let hi = self.class_atom()?;
                match (lo.as_slice(), hi.as_slice()) {
                    ([(a, a2)], [(b, b2)]) if a == a2 && b == b2 => {
                        if b < a {
                            return Err(self.err("a class range out of order"));
                        }
                        ranges.push((*a, *b));
                    }
                    _ => return Err(self.err("a class range needs single characters at both ends")),
                }
            } else {
                ranges.extend(lo);
            }
        }
        let r = normalize(ranges);
        Ok(if negate { complement(&r) } else { r })
    }

    fn class_atom(&mut self) -> Result<Vec<(u32, u32)>, String> {
        let c = self.peek().ok_or_else(|| self.err("missing `]`"))?;
        self.at += 1;
        if c == '\\' {
            return self.escape(true);
        }
        Ok(vec![(c as u32, c as u32)])
    }

    /// An escape after `\`; `in_class`: `\b` is a backspace there.
    fn escape(&mut self, in_class: bool) -> Result<Vec<(u32, u32)>, String> {
        let c = self.peek().ok_or_else(|| self.err("a pattern cannot end with `\\`"))?;
        self.at += 1;
        let one = |v: u32| Ok(vec![(v, v)]);
        match c {
            'd' => Ok(DIGIT.to_vec()),
            // The negated classes and `\s` keep only what ECMA-262 and Unicode-aware engines
            // (pydantic's) agree on: ASCII non-digits / non-word characters, white space
            // without U+FEFF, and non-space without U+0085.
            'D' => Ok(ascii_minus(DIGIT)),
            'w' => Ok(WORD.to_vec()),
            'W' => Ok(ascii_minus(WORD)),
            's' => Ok(SPACE.iter().copied().filter(|r| r.0 != 0xfeff).collect()),
            'S' => Ok(complement(&normalize(SPACE.iter().copied().chain([(0x85, 0x85)]).collect()))),
            'n' => one(0x0a),
            'r' => one(0x0d),
            't' => one(0x09),
            'f' => one(0x0c),
            'v' => one(0x0b),
            '0' if !self.peek().is_some_and(|c| c.is_ascii_digit()) => one(0),
            'b' if in_class => one(0x08),
            'b' | 'B' => Err(self.err("word boundaries (\\b, \\B) are not supported")),
            '1'..='9' => Err(self.err("back-references are not supported")),
            'p' | 'P' => Err(self.err("Unicode property escapes are not supported")),
            'x' => {
                let v = self.hex(2)?;
                one(v)
            }
            'u' => {
                let v = if self.eat('{') {
                    let s = self.at;
                    while self.peek().is_some_and(|c| c.is_ascii_hexdigit()) {
                        self.at += 1;
                    }
                    let v = u32::from_str_radix(&self.chars[s..self.at].iter().collect::<String>(), 16).map_err(|_| self.err("a bad \\u{...} escape"))?;
                    if !self.eat('}') || v > MAX_CHAR {
                        return Err(self.err("a bad \\u{...} escape"));
                    }
                    v
                } else {
                    let v = self.hex(4)?;
                    // A high surrogate's escape then its low half's: the one character they
                    // spell (as JSON and regex engines with Unicode semantics read them).
                    let low = (0xd800..=0xdbff).contains(&v) && self.peek() == Some('\\') && self.chars.get(self.at + 1) == Some(&'u');
                    if low {
                        let save = self.at;
                        self.at += 2;
                        match self.hex(4) {
                            Ok(l) if (0xdc00..=0xdfff).contains(&l) => return one(0x10000 + ((v - 0xd800) << 10) + (l - 0xdc00)),
                            _ => self.at = save,
                        }
                    }
                    v
                };
                one(v)
            }
            'c' => Err(self.err("control escapes (\\c) are not supported")),
            c if c.is_ascii_alphanumeric() => Err(self.err(&format!("unknown escape \\{c}"))),
            c => one(c as u32),
        }
    }

    fn hex(&mut self, n: usize) -> Result<u32, String> {
        let s: String = self.chars.get(self.at..self.at + n).map(|c| c.iter().collect()).unwrap_or_default();
        if s.len() != n || !s.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(self.err("a bad hex escape"));
        }
        self.at += n;
        Ok(u32::from_str_radix(&s, 16).expect("hex digits"))
    }
}

// ---- Thompson NFA and subset construction ----

#[derive(Default)]
struct Nfa {
    eps: Vec<Vec<u32>>,
    edges: Vec<Vec<(u32, u32, u32)>>,
    n_edges: usize,
}

/// Most units of work (edges swept, closure steps) one pattern's subset construction may take:
/// a short adversarial pattern (`(\s?){1000}[^a]{1000}`) is refused in well under a second
/// instead of compiling for tens of seconds.
const MAX_WORK: usize = 20_000_000;

impl Nfa {
    fn state(&mut self) -> u32 {
        self.eps.push(Vec::new());
        self.edges.push(Vec::new());
        (self.eps.len() - 1) as u32
    }

    fn eps(&mut self, a: u32, b: u32) {
        self.eps[a as usize].push(b);
    }

    /// A fragment (start, end) for `ast`.
    fn build(&mut self, ast: &Ast) -> Result<(u32, u32), String> {
        if self.eps.len() > MAX_NFA || self.n_edges > 4 * MAX_NFA {
            return Err(format!("the pattern expands to more than {MAX_NFA} automaton states"));
        }
        Ok(match ast {
            Ast::Set(r) => {
                let (s, e) = (self.state(), self.state());
                // No JSON string decodes to a lone surrogate: those code points never match.
                for (lo, hi) in r.iter().flat_map(|&(lo, hi)| [(lo, hi.min(0xd7ff)), (lo.max(0xe000), hi)]).filter(|r| r.0 <= r.1) {
                    self.edges[s as usize].push((lo, hi, e));
                    self.n_edges += 1;
                }
                (s, e)
            }
            Ast::Cat(items) => {
                let s = self.state();
                let mut cur = s;
                for it in items {
                    let (a, b) = self.build(it)?;
                    self.eps(cur, a);
                    cur = b;
                }
                (s, cur)
            }
            Ast::Alt(alts) => {
                let (s, e) = (self.state(), self.state());
                for a in alts {
                    let (x, y) = self.build(a)?;
                    self.eps(s, x);
                    self.eps(y, e);
                }
                (s, e)
            }
            Ast::Rep(inner, min, max) => {
                let s = self.state();
                let mut cur = s;
                for _ in 0..*min {
                    let (a, b) = self.build(inner)?;
                    self.eps(cur, a);
                    cur = b;
                }
                match max {
                    None => {
                        let (a, b) = self.build(inner)?;
                        self.eps(cur, a);
                        self.eps(b, a);
                        let e = self.state();
                        self.eps(cur, e);
                        self.eps(b, e);
                        (s, e)
                    }
                    Some(m) => {
                        let e = self.state();
                        self.eps(cur, e);
                        for _ in *min..*m {
                            let (a, b) = self.build(inner)?;
                            self.eps(cur, a);
                            self.eps(b, e);
                            cur = b;
                        }
                        (s, e)
                    }
                }
            }
        })
    }

    /// `set` closed under ε-moves, sorted; `work` is charged per step.
    fn closure(&self, set: &mut Vec<u32>, work: &mut usize) -> Result<(), String> {
        let mut seen: std::collections::HashSet<u32> = set.iter().copied().collect();
        let mut stack = set.clone();
        while let Some(s) = stack.pop() {
            *work += 1 + self.eps[s as usize].len();
            for &t in &self.eps[s as usize] {
                if seen.insert(t) {
                    set.push(t);
                    stack.push(t);
                }
            }
        }
        if *work > MAX_WORK {
            return Err("the pattern is too complex to compile (its automaton takes too long to build)".to_string());
        }
        set.sort_unstable();
        set.dedup();
        Ok(())
    }

    fn determinize(&self, start: u32, end: u32) -> Result<Dfa, String> {
        let mut work = 0usize;
        let mut first = vec![start];
        self.closure(&mut first, &mut work)?;
        let mut ids: HashMap<Vec<u32>, u32> = HashMap::new();
        let mut sets = vec![first.clone()];
        ids.insert(first, 0);
        let mut states = Vec::new();
        let mut i = 0;
        while i < sets.len() {
            let set = std::mem::take(&mut sets[i]);
            // Elementary intervals by a sweep over the edges' boundaries: at each boundary the
            // edges starting there join, those ending before it leave.
            let mut events: Vec<(u32, bool, u32)> = Vec::new();
            for &s in &set {
                for &(lo, hi, to) in &self.edges[s as usize] {
                    events.push((lo, true, to));
                    events.push((hi + 1, false, to));
                }
            }
            work += events.len();
            events.sort_unstable();
            let mut active: HashMap<u32, u32> = HashMap::new();
            let mut trans = Vec::new();
            let mut k = 0;
            while k < events.len() {
                let at = events[k].0;
                while k < events.len() && events[k].0 == at {
                    let (_, add, to) = events[k];
                    let c = active.entry(to).or_insert(0);
                    if add {
                        *c += 1;
                    } else {
                        *c -= 1;
                        if *c == 0 {
                            active.remove(&to);
                        }
                    }
                    k += 1;
                }
                if active.is_empty() || k == events.len() {
                    continue;
                }
                let (lo, hi) = (at, events[k].0 - 1);
                let mut to: Vec<u32> = active.keys().copied().collect();
                work += to.len();
                self.closure(&mut to, &mut work)?;
                let next = match ids.get(&to) {
                    Some(&n) => n,
                    None => {
                        if sets.len() >= MAX_STATES {
                            return Err(format!("the pattern needs more than {MAX_STATES} automaton states"));
                        }
                        let n = sets.len() as u32;
                        ids.insert(to.clone(), n);
                        sets.push(to);
                        n
                    }
                };
                push_range(&mut trans, lo, hi, next);
            }
            states.push(DState { accept: set.binary_search(&end).is_ok(), trans });
            i += 1;
        }
        Ok(Dfa { states })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_what_ecmascript_matches() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            (r"^[a-z]+$", &["abc", "z"], &["", "aB", "ab1"]),
            (r"^\d{3}-\d{4}$", &["555-1234"], &["5555-1234", "555-123", "abc-defg"]),
            (r"abc", &["abc", "xxabcxx", "abcabc"], &["ab", "acb"]),
            (r"^abc", &["abc", "abcdef"], &["xabc"]),
            (r"abc$", &["xxabc"], &["abcx"]),
            (r"^(cat|dog)s?$", &["cat", "dogs"], &["cats!", "bird"]),
            (r"^a{2,3}$", &["aa", "aaa"], &["a", "aaaa"]),
            (r"^a{2,}$", &["aa", "aaaaaaa"], &["a"]),
            (r"^[^0-9\s]*$", &["", "abc_é"], &["a1", "a b"]),
            (r"^\w+@\w+\.com$", &["a_1@b.com"], &["a@b.org", "@b.com"]),
            (r"^.$", &["x", "é", "😀"], &["\n", "xy"]),
            (r"^\u00e9\x41[\-.]$", &["éA-", "éA."], &["éA,"]),
            (r"^x*?y+?$", &["y", "xxyy"], &["x"]),
            (r"^(?:ab|cd)(?<n>e)$", &["abe", "cde"], &["ade"]),
            (r"^[]$|^ok$", &["ok"], &[""]),
            (r"^a|b$", &["ax", "xb"], &["xa", "bx"]),
            (r"^{1}$", &["{1}"], &["{"]),
            (r"^[\w-]+$", &["a-b_c"], &["a b"]),
        ];
        for (p, yes, no) in cases {
            let d = Dfa::from_pattern(p).unwrap_or_else(|e| panic!("{p}: {e}"));
            for s in *yes {
                assert!(d.matches(s), "{p} must match {s:?}");
            }
            for s in *no {
                assert!(!d.matches(s), "{p} must not match {s:?}");
            }
        }
    }

    #[test]
    fn unsupported_and_malformed_patterns_are_refused_with_the_reason() {
        for (p, why) in [
            (r"(a)\1", "back-references"),
            (r"a(?=b)", "look-around"),
            (r"\bword", "word boundaries"),
            (r"\p{L}", "property"),
            (r"a^b", "anchors"),
            (r"a$b", "`$`"),
            (r"(ab", "missing `)`"),
            (r"ab)", "unbalanced"),
            (r"[ab", "missing `]`"),
            (r"[z-a]", "out of order"),
            (r"a**", "quantifier"),
            (r"*a", "nothing to repeat"),
            (r"a{3,2}", "m < n"),
            (r"a{5000}", "counts above"),
            (r"\q", "unknown escape"),
            (r"^[]$", "no string"),
        ] {
            let e = Dfa::from_pattern(p).expect_err(p);
            assert!(e.contains(why), "{p}: {e}");
        }
    }

    #[test]
    fn formats_accept_valid_values_and_refuse_others() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            ("date-time", &["2024-02-28T13:45:00Z", "1999-12-31T23:59:59.123+05:30"], &["2024-13-01T00:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01T00:00:00", "2024-01-01", "2024-04-31T00:00:00Z", "0999-01-01T00:00:00Z"]),
            ("date", &["2024-01-31", "2023-11-30"], &["2024-1-31", "2024-01-32", "2024-02-30", "2024-11-31"]),
            ("time", &["08:30:00Z", "23:59:59.5+01:00"], &["8:30:00Z", "24:00:00Z", "08:30:00"]),
            ("uuid", &["123e4567-e89b-12d3-a456-426614174000"], &["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"]),
            ("email", &["a.b+c@example.co.uk", "x@a-b.io"], &["a@b", "a..b@example.com", "@example.com", "a@-example.com", "a@b.c1", "a@b.test", "a@b.local", "a@ab--c.com"]),
            ("ipv4", &["192.168.0.1", "0.0.0.0"], &["256.1.1.1", "1.2.3", "01.2.3.4"]),
            ("hostname", &["example.com", "localhost", "a-b.c"], &["-bad.com", "a..b", "ab--c", "ab-"]),
            ("uri", &["https://example.com/a%20b?b=c", "ftp://h:21/", "http://a:65535"], &["example.com", "http://a b", "http://a/%zz", "http://a/#x", "http://a:99999", "http://a.1", "http://1.2.3.999", "http://xn--a", "file://a:80"]),
        ];
        for (f, yes, no) in cases {
            let d = Dfa::from_pattern(format_pattern(f).unwrap()).unwrap();
            for s in *yes {
                assert!(d.matches(s), "{f} must accept {s:?}");
            }
            for s in *no {
                assert!(!d.matches(s), "{f} must refuse {s:?}");
            }
        }
        assert_eq!(format_pattern("color"), None);
    }

    #[test]
    fn lengths_intersect_with_patterns_and_dead_ends_are_pruned() {
        let p = Dfa::from_pattern(r"^[ab]*c?$").unwrap();
        let both = p.intersect(&Dfa::length(2, 3).unwrap()).unwrap().unwrap();
        for (s, ok) in [("ab", true), ("abc", true), ("a", false), ("abab", false), ("ac", true), ("cc", false)] {
            assert_eq!(both.matches(s), ok, "{s}");
        }
        // After "abc" nothing may follow: the state has no way on.
        let mut st = Dfa::START;
        for c in "abc".chars() {
            st = both.next(st, c as u32).unwrap();
        }
        assert!(both.accepts(st) && !both.any_in(st, 0, MAX_CHAR));
        // Every state left can still reach an accepting one; an impossible pair is None.
        assert!(Dfa::from_pattern(r"^a{5}$").unwrap().intersect(&Dfa::length(0, 3).unwrap()).unwrap().is_none());
        let unb = p.intersect(&Dfa::length(3, u32::MAX).unwrap()).unwrap().unwrap();
        assert!(unb.matches("aaaaaaaaab") && !unb.matches("ab"));
    }

    #[test]
    fn without_refuses_only_the_whole_tag() {
        let d = Dfa::without("</p>");
        for ok in ["", "a<b", "</", "</p", "<</p", "</x></p", "é</p", "x<"] {
            assert!(d.matches(ok), "{ok:?}");
        }
        for bad in ["</p>", "a</p>b", "<</p>", "</</p>"] {
            assert!(!d.matches(bad), "{bad:?}");
        }
        let both = d.intersect(&Dfa::length(1, 3).unwrap()).unwrap().unwrap();
        assert!(both.matches("a<b") && !both.matches("") && !both.matches("abcd"));
    }

    #[test]
    fn any_in_sees_ranges_across_transitions() {
        let d = Dfa::from_pattern(r"^[a-c]|[x-z]$").unwrap();
        let d = d.intersect(&Dfa::length(1, 1).unwrap()).unwrap().unwrap();
        assert!(d.any_in(Dfa::START, 0x62, 0x62));
        assert!(d.any_in(Dfa::START, 0x00, 0x61));
        assert!(!d.any_in(Dfa::START, 0x64, 0x77));
        assert!(d.any_in(Dfa::START, 0x64, 0x78));
    }
}
