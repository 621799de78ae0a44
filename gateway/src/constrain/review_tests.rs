//! Review tests (session 32's review of structured outputs' `pattern` / `format` / integer
//! bounds): each was a bug found in review (a dead end, a document a validator refuses, a
//! panic, a slow compile), kept as a regression test; with exhaustive and random-walk checks
//! that every kept state can still be completed.

use std::collections::HashSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde_json::{Value as Json, json};

use super::matcher::State;
use super::regex::Dfa;
use super::schema::Grammar;

fn g(s: &Json) -> Grammar {
    Grammar::from_schema(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn feed(gr: &Grammar, bytes: &[u8]) -> Option<State> {
    let mut s = State::start(gr);
    s.feed(gr, bytes).then_some(s)
}

fn accepts(gr: &Grammar, text: &str) -> bool {
    feed(gr, text.as_bytes()).is_some_and(|s| s.can_end(gr))
}

/// Validator with formats asserted (what the brief says must accept every document).
fn valid(schema: &Json, doc: &str) -> bool {
    let v = jsonschema::options().should_validate_formats(true).build(schema).unwrap();
    v.is_valid(&serde_json::from_str::<Json>(doc).unwrap())
}

/// Bytes in the order a completion search tries them (closers first, then ASCII, then the rest).
fn byte_order() -> Vec<u8> {
    let mut v: Vec<u8> = b"\"}]0123456789".to_vec();
    for b in (0x20..=0x7eu8).chain(0x80..=0xff).chain(0..0x20) {
        if !v.contains(&b) {
            v.push(b);
        }
    }
    v
}

/// Whether some byte string completes `s` into a whole document: `Some(true)` found, `Some(false)`
/// every reachable state explored without one (a proven dead end), `None` out of budget.
pub(crate) fn completable(gr: &Grammar, s: &State, budget: usize) -> Option<bool> {
    let order = byte_order();
    let mut seen: HashSet<State> = HashSet::new();
    let mut stack = vec![(s.clone(), 0u32)];
    let mut limited = false;
    while let Some((st, depth)) = stack.pop() {
        if st.can_end(gr) {
            return Some(true);
        }
        if !seen.insert(st.clone()) {
            continue;
        }
        if seen.len() > budget {
            return None;
        }
        if depth > 400 {
            limited = true;
            continue;
        }
        for &b in order.iter().rev() {
            let n = st.step(gr, b);
            if !n.is_dead() && !seen.contains(&n) {
                stack.push((n, depth + 1));
            }
        }
    }
    if limited { None } else { Some(false) }
}

// ---------------------------------------------------------------------------------------------
// 1. Patterns whose only way to acceptance is through UTF-16 surrogate code points.

#[test]
fn a_surrogate_pair_in_a_pattern_is_the_one_character_it_spells() {
    // JS writes astral characters in patterns as surrogate pairs: the emoji, raw or escaped
    // as a pair in the document (once the pattern read them as two unwritable code points,
    // and the state after the quote was a dead end).
    let gr = g(&json!({"type": "string", "pattern": "^\\ud83d\\ude00$"}));
    let s = feed(&gr, b"\"").expect("the opening quote is kept");
    let live: Vec<u8> = (0..=255u8).filter(|&b| !s.step(&gr, b).is_dead()).collect();
    assert_eq!(live, vec![b'\\', 0xf0]);
    assert_eq!(completable(&gr, &s, 2_000_000), Some(true));
    assert!(accepts(&gr, "\"😀\"") && accepts(&gr, r#""\ud83d\ude00""#));
}

#[test]
fn a_lone_surrogate_in_a_pattern_matches_nothing() {
    // No JSON string decodes to a lone surrogate: the schema is refused, not a dead end.
    let e = Grammar::from_schema(&json!({"type": "string", "pattern": "\\ud800"})).unwrap_err();
    assert!(e.why.contains("no string matches"), "{}", e.why);
    // Classes that span the surrogates keep the rest.
    let gr = g(&json!({"type": "string", "pattern": "^[\\ud000-\\ue000]$"}));
    assert!(accepts(&gr, "\"\u{d7ff}\"") && accepts(&gr, "\"\u{e000}\"") && !accepts(&gr, r#""\udbff\udfff""#));
}

// ---------------------------------------------------------------------------------------------
// 2. Integer bounds beyond i64 / beyond f64 precision.

#[test]
fn minimum_above_i64_accepts_an_integer_below_it() {
    let s = json!({"type": "integer", "minimum": 1e19});
    // Should be refused ("no integer fits" in i64) or accept nothing below 1e19.
    if let Ok(gr) = Grammar::from_schema(&s) {
        let doc = "9223372036854775807";
        assert!(!valid(&s, doc));
        assert!(!accepts(&gr, doc), "accepted {doc}, below minimum 1e19");
    }
}

#[test]
fn minimum_two_to_the_63_accepts_i64_max() {
    let s = json!({"type": "integer", "minimum": 9223372036854775808u64});
    if let Ok(gr) = Grammar::from_schema(&s) {
        let doc = "9223372036854775807";
        assert!(!valid(&s, doc));
        assert!(!accepts(&gr, doc), "accepted {doc} < 2^63");
    }
}

#[test]
fn integer_bounds_lose_precision_through_f64() {
    let s = json!({"type": "integer", "minimum": 9007199254740993u64});
    let gr = g(&s);
    let doc = "9007199254740992";
    assert!(!valid(&s, doc));
    assert!(!accepts(&gr, doc), "accepted {doc} < minimum 9007199254740993");
    let s = json!({"type": "integer", "maximum": -9007199254740993i64});
    let gr = g(&s);
    let doc = "-9007199254740992";
    assert!(!valid(&s, doc));
    assert!(!accepts(&gr, doc), "accepted {doc} > maximum -9007199254740993");
}

#[test]
fn exclusive_bounds_beyond_i64_overflow() {
    // Debug: `attempt to add with overflow` in int_bounds; release: lo wraps to i64::MIN and
    // every integer is accepted.
    for s in [json!({"type": "integer", "exclusiveMinimum": 1e19}), json!({"type": "integer", "exclusiveMaximum": -1e19})] {
        let r = std::panic::catch_unwind(|| Grammar::from_schema(&s).map(|gr| accepts(&gr, "0")));
        match r {
            Err(_) => panic!("{s}: int_bounds panicked (overflow)"),
            Ok(Ok(true)) => panic!("{s}: accepts 0"),
            Ok(_) => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Formats: values the built-in patterns admit that validators reject.

#[test]
fn uri_format_admits_urls_pydantic_rejects() {
    // pydantic AnyUrl (JSON schema: {"type":"string","format":"uri"}) rejects each of these:
    // "invalid port number" / "invalid IPv4 address" (WHATWG URL: a host whose last label is
    // numeric is parsed as IPv4).
    let gr = g(&json!({"type": "string", "format": "uri"}));
    let bad: Vec<&str> = [r#""http://a:99999""#, r#""http://999999999999""#, r#""http://a.1""#, r#""http://1.2.3.999""#]
        .into_iter()
        .filter(|doc| accepts(&gr, doc))
        .collect();
    assert!(bad.is_empty(), "format uri admits {bad:?}, which pydantic's AnyUrl refuses");
}

#[test]
fn format_outside_the_string_schema_is_not_enforced() {
    match [
        (json!({"type": "string", "format": "date", "enum": ["nope"]}), r#""nope""#),
        (json!({"type": "string", "format": "date", "const": "nope"}), r#""nope""#),
        (json!({"format": "date", "anyOf": [{"type": "string"}, {"type": "null"}]}), r#""nope""#),
        (json!({"format": "date", "allOf": [{"type": "string"}]}), r#""nope""#),
        (json!({"pattern": "^a$"}), r#""b""#),
        (json!({"format": "date"}), r#""nope""#),
    ]
    .iter()
    .filter(|(s, doc)| Grammar::from_schema(s).is_ok_and(|gr| accepts(&gr, doc)) && !valid(s, doc))
    .map(|(s, doc)| format!("{s}: accepts {doc}"))
    .collect::<Vec<_>>()
    .as_slice()
    {
        [] => {}
        bad => panic!("the validator (formats on) refuses: {bad:#?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Regex semantics.

#[test]
fn negated_perl_classes_admit_what_unicode_regex_engines_exclude() {
    // pydantic (Rust `regex`, Unicode classes) refuses each of these; ECMA-262 accepts them.
    let bad: Vec<(&str, &str)> = [(r"^\D$", "\"\u{663}\""), (r"^\W$", "\"é\""), (r"^\S$", "\"\\u0085\""), (r"^\s$", "\"\\ufeff\"")]
        .into_iter()
        .filter(|(p, doc)| accepts(&g(&json!({"type": "string", "pattern": p})), doc))
        .collect();
    assert!(bad.is_empty(), "admitted, though pydantic refuses: {bad:?}");
}

// ---------------------------------------------------------------------------------------------
// 5. Adversarial patterns: time to compile (or refuse).

/// Patterns of a few characters that once compiled for 20-30 s in the request handler: a
/// work budget (edges swept, closure steps; not a clock) refuses them, and the cheap ones still
/// compile.
#[test]
fn adversarial_patterns_are_refused_by_the_work_budget_not_compiled_for_seconds() {
    let many: String = (0..3000u32).map(|i| char::from_u32(0x4e00 + 2 * i).unwrap()).collect();
    for p in [r"(\s?){1000}[^a]{1000}", r"^(.?){1000}(a|b)*a(a|b){12}$", r"(a|b)*a(a|b){12}(.?){900}$", r"(\w|\s|\d|\W|\S|\D)*x(\w|\s|\d){12}"] {
        let e = Dfa::from_pattern(p).expect_err(p);
        assert!(e.contains("too complex"), "{p}: {e}");
    }
    assert!(Dfa::from_pattern(&format!("^[{many}]{{1000}}$")).expect_err("a class copied 1,000 times").contains("more than"));
    for p in ["(a|aa)*", "(.*){1000}", "[^a]{1000}", "(.?){1000}x"] {
        assert!(Dfa::from_pattern(p).is_ok(), "{p}");
    }
}

#[test]
fn hostname_format_admits_double_hyphen_labels_jsonschema_rejects() {
    // jsonschema (RFC 5891): a label with `--` at positions 3-4 must be a valid A-label.
    let s = json!({"type": "string", "format": "hostname"});
    let gr = g(&s);
    let doc = r#""ab--c""#;
    assert!(!valid(&s, doc));
    assert!(!accepts(&gr, doc), "format hostname admits {doc}; jsonschema (formats on) refuses it");
}

// ---------------------------------------------------------------------------------------------
// 6. Property: random byte walks; every kept state can be completed, every document validates.


fn walk_schema(s: &Json, seeds: u64, budget: usize) -> Vec<String> {
    let gr = g(s);
    let validator = jsonschema::options().should_validate_formats(true).build(s).unwrap();
    let mut problems = Vec::new();
    for seed in 0..seeds {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut st = State::start(&gr);
        let mut out: Vec<u8> = Vec::new();
        let mut ok = true;
        for _ in 0..120 {
            if st.can_end(&gr) && rng.random_range(0..6) == 0 {
                break;
            }
            let live: Vec<u8> = (0..=255u8).filter(|&b| !st.step(&gr, b).is_dead()).collect();
            if live.is_empty() {
                if !st.can_end(&gr) {
                    problems.push(format!("{s}: dead end (no byte) after {:?}", String::from_utf8_lossy(&out)));
                    ok = false;
                }
                break;
            }
            let b = live[rng.random_range(0..live.len())];
            st = st.step(&gr, b);
            out.push(b);
            if completable(&gr, &st, budget) == Some(false) {
                problems.push(format!("{s}: no completion after {:?} ({out:x?})", String::from_utf8_lossy(&out)));
                ok = false;
                break;
            }
        }
        if !ok || !st.can_end(&gr) {
            continue;
        }
        let text = match String::from_utf8(out.clone()) {
            Ok(t) => t,
            Err(_) => {
                problems.push(format!("{s}: not UTF-8: {out:x?}"));
                continue;
            }
        };
        match serde_json::from_str::<Json>(&text) {
            Err(e) => problems.push(format!("{s}: {text:?} does not parse: {e}")),
            Ok(doc) => {
                let errs: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
                if !errs.is_empty() {
                    problems.push(format!("{s}: {text:?} invalid: {errs:?}"));
                }
            }
        }
    }
    problems
}

#[test]
fn random_byte_walks_never_dead_end_and_validate() {
    let schemas = [
        json!({"type": "string", "pattern": "^[à-ÿ一-丐]{1,4}$"}),
        json!({"type": "string", "pattern": "^[\u{7f}\u{80}\u{7ff}\u{800}\u{d7ff}\u{e000}\u{fffd}\u{ffff}\u{10000}\u{10ffff}]{1,3}$"}),
        json!({"type": "string", "pattern": "^(😀|a)é$"}),
        json!({"type": "string", "pattern": "^[\\x01-\\x1f\"\\\\/]{1,3}$"}),
        json!({"type": "string", "pattern": "^[^a-z]{2}x$"}),
        json!({"type": "string", "pattern": "^(ab|a)*c$", "maxLength": 5}),
        json!({"type": "string", "pattern": "^\\w+$", "minLength": 3, "maxLength": 4}),
        json!({"type": "string", "format": "date-time"}),
        json!({"type": "string", "format": "date"}),
        json!({"type": "string", "format": "time"}),
        json!({"type": "string", "format": "uuid"}),
        json!({"type": "string", "format": "email"}),
        json!({"type": "string", "format": "hostname"}),
        json!({"type": "string", "format": "ipv4"}),
        json!({"type": "string", "format": "uri"}),
        json!({"type": "integer", "minimum": -9223372036854775808i64, "maximum": 9223372036854775807i64}),
        json!({"type": "integer", "minimum": -15, "maximum": -3}),
        json!({"type": "integer", "minimum": 7, "maximum": 7}),
        json!({"type": "integer", "minimum": 1000000000000000000i64}),
        json!({"type": "integer", "maximum": -1000000000000000000i64}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 0}, "maxItems": 3}),
        json!({"type": "number", "minimum": 0, "maximum": 1}),
        json!({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
        json!({"type": "number", "minimum": -2.5, "exclusiveMaximum": -2.25}),
        json!({"type": "number", "minimum": 0.1, "maximum": 0.1}),
        json!({"type": "number", "exclusiveMinimum": 0.30000000000000004, "maximum": 0.31}),
        json!({"type": "number", "minimum": 123456.789, "maximum": 1e14}),
        json!({"type": "number", "maximum": -1e-10}),
        json!({"type": "array", "items": {"type": "number", "minimum": 99.5, "maximum": 100.25}, "maxItems": 3}),
        json!({"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]{2}$"}, "n": {"type": "integer", "exclusiveMinimum": -2, "exclusiveMaximum": 2}}, "required": ["d", "n"], "additionalProperties": false}),
    ];
    let mut problems = Vec::new();
    for s in &schemas {
        problems.extend(walk_schema(s, 60, 20_000));
    }
    for p in &problems {
        eprintln!("{p}");
    }
    assert!(problems.is_empty(), "{} problems", problems.len());
}


#[test]
fn differential_patterns_against_jsonschema() {
    let cases: &[(&str, &[&str])] = &[
        (r"^[a-]$", &["a", "-", "b"]),
        (r"^[-a]$", &["a", "-"]),
        (r"^[\w-]$", &["-", "a"]),
        (r"^(|a)b$", &["b", "ab"]),
        (r"^a||b$", &["a", "xb", "anything"]),
        (r"^a{,2}$", &["a{,2}", "aa", ""]),
        (r"^x{2}{3}$", &["xx{3}", "xxxxxx"]),
        (r"^a{2}b{$", &["aab{"]),
        (r"^\u{41}$", &["A"]),
        (r"^[^]$", &["x", "\n"]),
        (r"^a]$", &["a]"]),
        (r"^a}$", &["a}"]),
        (r"^[\]]$", &["]"]),
        (r"^[^\]]$", &["]", "a"]),
        (r"^.$", &["\r", "\u{2028}", "\u{85}"]),
        (r"^[\s]$", &["\u{85}", "\u{feff}", "\u{a0}"]),
        (r"^\S$", &["\u{85}"]),
        (r"^\d$", &["\u{663}", "7"]),
        (r"^\w$", &["é", "_"]),
        (r"^[\b]$", &["\u{8}"]),
        (r"^\0$", &["\0"]),
        (r"^\x41\u0042$", &["AB"]),
        (r"^(?<n>a)+$", &["aa"]),
        (r"^a{0}$", &["", "a"]),
        (r"^(a|b)*?c+?$", &["abcc"]),
        (r"^[.]$", &["x", "."]),
        (r"^\/\-$", &["/-"]),
        (r"^😀{2}$", &["😀😀"]),
        (r"^[😀-😂]$", &["😁"]),
        (r"^\$$", &["$"]),
        (r"^[$^]+$", &["$^"]),
    ];
    let mut diffs = Vec::new();
    for (p, strs) in cases {
        let d = match Dfa::from_pattern(p) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("refused {p}: {e}");
                continue;
            }
        };
        let v = match jsonschema::options().build(&json!({"type": "string", "pattern": p})) {
            Ok(v) => v,
            Err(e) => {
                // Syntax ECMA-262 refuses and this parser reads leniently (`a{,2}`, `[^]`):
                // there is no validator to disagree with.
                eprintln!("{p}: jsonschema refuses the pattern ({e}); the DFA compiles it");
                continue;
            }
        };
        for s in *strs {
            // Narrower than the validator is by design (the classes both engines agree on);
            // wider would write values it refuses.
            let (a, b) = (d.matches(s), v.is_valid(&json!(s)));
            if a && !b {
                diffs.push(format!("{p} on {s:?}: dfa {a}, jsonschema {b}"));
            }
        }
    }
    for x in &diffs {
        eprintln!("{x}");
    }
    assert!(diffs.is_empty());
}

/// Every state reachable from `s` can be completed (exhaustive; the state space must be finite).
fn every_reachable_state_completes(gr: &Grammar, s: &State, cap: usize) -> Result<usize, String> {
    let mut seen: HashSet<State> = HashSet::new();
    let mut stack = vec![(s.clone(), Vec::<u8>::new())];
    while let Some((st, path)) = stack.pop() {
        if !seen.insert(st.clone()) {
            continue;
        }
        if seen.len() > cap {
            return Err("cap".into());
        }
        if completable(gr, &st, 100_000) == Some(false) {
            return Err(format!("dead end after {path:x?}"));
        }
        if st.at_end() {
            continue;
        }
        for b in 0..=255u8 {
            let n = st.step(gr, b);
            if !n.is_dead() && !seen.contains(&n) {
                let mut p = path.clone();
                p.push(b);
                stack.push((n, p));
            }
        }
    }
    Ok(seen.len())
}

#[test]
fn single_characters_at_encoding_boundaries_never_dead_end() {
    let cps: &[u32] = &[
        0x08, 0x1f, 0x22, 0x2f, 0x5c, 0x7f, 0x80, 0x7ff, 0x800, 0xfff, 0x1000, 0xcfff, 0xd000, 0xd7ff, 0xe000, 0xfffd, 0xffff,
        0x10000, 0x3ffff, 0x40000, 0xfffff, 0x100000, 0x10ffff,
    ];
    let mut bad = Vec::new();
    for (i, &a) in cps.iter().enumerate() {
        for &b in &cps[i..] {
            let p = format!("^[\\u{{{a:x}}}-\\u{{{b:x}}}]$");
            let p2 = format!("^[\\u{{{a:x}}}\\u{{{b:x}}}]$");
            for pat in [p, p2] {
                let gr = g(&json!({"type": "string", "pattern": pat}));
                let s = feed(&gr, b"\"").unwrap();
                if let Err(e) = every_reachable_state_completes(&gr, &s, 3000)
                    && e != "cap"
                {
                    bad.push(format!("{pat}: {e}"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn email_format_admits_addresses_pydantic_emailstr_rejects() {
    // pydantic's EmailStr ({"type":"string","format":"email"}, email-validator 2.x) refuses:
    // special-use TLDs (arpa, invalid, local, localhost, onion, test) and a label with `--` at
    // positions 3-4 ("An email address cannot have two letters followed by two dashes").
    let gr = g(&json!({"type": "string", "format": "email"}));
    let bad: Vec<&str> = [r#""a@b.test""#, r#""a@b.local""#, r#""a@b.invalid""#, r#""a@b.localhost""#, r#""a@b.onion""#, r#""a@b.arpa""#, r#""a@ab--c.com""#]
        .into_iter()
        .filter(|d| accepts(&gr, d))
        .collect();
    assert!(bad.is_empty(), "format email admits {bad:?}, which pydantic's EmailStr refuses");
}

#[test]
fn a_quantifier_after_a_counted_quantifier_is_refused() {
    // ECMA-262: `x{2}{3}` is a SyntaxError; Rust `regex` (pydantic) reads it as (x{2}){3}. It
    // once took the second count as literal text.
    let e = Grammar::from_schema(&json!({"type": "string", "pattern": "^x{2}{3}$"})).unwrap_err();
    assert!(e.why.contains("quantifier cannot follow"), "{}", e.why);
}
