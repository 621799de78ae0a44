//! Schemas and documents at the edges, each a bug a review found (a crash, a dead end, or a
//! document that broke its schema): the matcher must refuse or survive them, and agree with an
//! independent validator (the `jsonschema` crate) on what it accepts.

use serde_json::{Value as Json, json};

use super::matcher::tests::{accepts, prefix_ok};
use super::matcher::{MAX_THREADS, State};
use super::schema::Grammar;

fn g(s: &Json) -> Grammar {
    Grammar::from_schema(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// The matcher and the validator agree on `doc` (which must parse).
fn agrees(schema: &Json, doc: &str) {
    let valid = jsonschema::validator_for(schema).unwrap().is_valid(&serde_json::from_str::<Json>(doc).unwrap());
    assert_eq!(accepts(&g(schema), doc), valid, "{schema} on {doc}");
}

#[test]
fn references_that_write_nothing_neither_loop_nor_dead_end() {
    let s = json!({"anyOf": [{"$ref": "#"}, {"type": "null"}]});
    assert!(accepts(&g(&s), "null") && !prefix_ok(&g(&s), "1"));
    let s = json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}});
    assert!(accepts(&g(&s), "{}") && !prefix_ok(&g(&s), "{\"x\""), "x can never be written");
    let s = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "properties": {"x": {"$ref": "#/$defs/a"}}, "additionalProperties": false});
    assert!(accepts(&g(&s), "{}") && !prefix_ok(&g(&s), "{\"x\""));
}

#[test]
fn long_reference_chains_are_refused_not_a_crash() {
    let mut defs = serde_json::Map::new();
    for i in 0..10_000 {
        defs.insert(format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}));
    }
    defs.insert("a10000".into(), json!({"type": "string"}));
    let s = json!({"$defs": defs, "$ref": "#/$defs/a0"});
    // A tokio worker's stack.
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || Grammar::from_schema(&s).map(|_| ())).unwrap().join().unwrap();
    assert!(r.unwrap_err().why.contains("nest too deep"));
}

#[test]
fn what_can_never_be_completed_is_cut_where_optional() {
    let n = json!({"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]});
    for (s, ok, never) in [
        (json!({"$defs": {"n": n}, "type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}}), "{}", "{\"x\""),
        (json!({"$defs": {"n": n}, "anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}), "null", "{"),
        (json!({"$defs": {"n": n}, "type": "array", "items": {"$ref": "#/$defs/n"}}), "[]", "[{"),
        (json!({"$defs": {"n": n}, "type": "object", "additionalProperties": {"$ref": "#/$defs/n"}}), "{}", "{\"k\""),
    ] {
        let gr = g(&s);
        assert!(accepts(&gr, ok) && !prefix_ok(&gr, never), "{s}");
    }
    // minItems of billions is read, not looped over.
    assert!(Grammar::from_schema(&json!({"type": "array", "minItems": 4_000_000_000u64, "items": {"type": "null"}})).is_ok());
}

#[test]
fn other_spellings_of_declared_keys_are_not_additional_keys() {
    let s = json!({"properties": {"a": {"type": "integer"}, "a/b": {"type": "integer"}, "q\"": {"type": "integer"}}, "additionalProperties": {"type": "string"}});
    for doc in [r#"{"\u0061": "x"}"#, r#"{"a": 1, "\u0061": "x"}"#, r#"{"a\/b": "x"}"#, r#"{"q\"": 1}"#, r#"{"b": "x"}"#] {
        agrees(&s, doc);
    }
}

#[test]
fn surrogate_escapes_come_in_pairs_and_count_once() {
    let one = r#""\ud83d\ude00""#;
    agrees(&json!({"type": "string", "minLength": 2}), one);
    agrees(&json!({"type": "string", "maxLength": 1}), one);
    for lone in [r#""\ud800""#, r#""\udc00""#, r#""\ud800x""#, r#""\ud800\u0041""#] {
        assert!(!accepts(&g(&json!({"type": "string"})), lone), "{lone}");
    }
}

#[test]
fn keywords_beside_combinators_hold_or_are_refused() {
    for (s, doc) in [
        (json!({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}), "1"),
        (json!({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}), "\"abc\""),
        (json!({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}), "\"abcde\""),
        (json!({"type": "string", "allOf": [{"maxLength": 3}]}), "1"),
        (json!({"type": "string", "enum": ["a", 1]}), "1"),
        (json!({"type": "string", "enum": ["a", 1]}), "\"a\""),
    ] {
        agrees(&s, doc);
    }
    let err = |s: Json| Grammar::from_schema(&s).unwrap_err().path;
    assert_eq!(err(json!({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1})), "#/$ref");
    assert_eq!(err(json!({"type": "object", "properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]})), "#/anyOf/0");
}

#[test]
fn unions_and_nesting_stay_bounded() {
    let s = json!({"$defs": {"node": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "additionalProperties": false},
        {"type": "object", "properties": {"id": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "additionalProperties": false}
    ]}}, "$ref": "#/$defs/node"});
    let gr = g(&s);
    let mut st = State::start(&gr);
    assert!(st.feed(&gr, "{\"children\":[".repeat(16).as_bytes()));
    assert!(st.threads() <= MAX_THREADS, "{} threads", st.threads());
    // Nesting beyond what JSON parsers take is refused, not a stack overflow.
    let any = Grammar::any_object();
    assert!(prefix_ok(&any, &format!("{{\"a\":{}", "[".repeat(90))));
    assert!(!prefix_ok(&any, &format!("{{\"a\":{}", "[".repeat(5000))));
}

/// Patterned strings: characters are checked as decoded (escapes, surrogate pairs, UTF-8), and
/// a partial character is refused as soon as no completion of it can match.
#[test]
fn patterned_strings_check_decoded_characters_and_prune_partial_ones() {
    let pg = g(&json!({"type": "string", "pattern": "^[a-z😀]{1,3}$"}));
    let ok = |text: &str| {
        let mut s = State::start(&pg);
        s.feed(&pg, text.as_bytes()) && s.can_end(&pg)
    };
    let alive = |text: &str| {
        let mut s = State::start(&pg);
        s.feed(&pg, text.as_bytes())
    };
    assert!(ok(r#""abc""#));
    assert!(ok(r#""\u0061b""#), "an escaped letter is the letter");
    assert!(ok("\"a😀\""), "a four-byte character");
    assert!(ok(r#""\ud83d\ude00""#), "the same character as a surrogate pair");
    assert!(!alive(r#""abcd"#), "a fourth character");
    assert!(!alive(r#""A"#));
    assert!(!ok(r#""""#), "at least one character");
    // Partial characters that can no longer become a letter or the emoji die at once.
    assert!(alive(r#""\u00"#) && !alive(r#""\u00f"#), "\\u00f_ is no letter");
    assert!(alive(r#""\ud83d"#) && !alive(r#""\ud83c"#), "only the emoji's high surrogate");
    assert!(alive(r#""\ud83d\ude0"#) && !alive(r#""\ud83d\ude1"#));
    let alive_bytes = |bytes: &[u8]| {
        let mut s = State::start(&pg);
        s.feed(&pg, bytes)
    };
    assert!(alive_bytes(b"\"\xf0\x9f") && !alive_bytes(b"\"\xc3"), "a two-byte lead can be no letter");
    assert!(!alive_bytes(b"\"\xf0\x90"), "nor can this four-byte prefix become the emoji");
    assert!(!alive(r#""\n"#), "a newline is not in the class");
    // A format with a pattern: both hold.
    let g2 = g(&json!({"type": "string", "format": "date", "pattern": "^2024"}));
    let mut s = State::start(&g2);
    assert!(s.feed(&g2, br#""2024-02-28""#) && s.can_end(&g2));
    // The built-in date is a strict subset of the format: no 29 February (no leap years).
    let mut s = State::start(&g2);
    assert!(!s.feed(&g2, br#""2024-02-29"#));
    let mut s = State::start(&g2);
    assert!(!s.feed(&g2, br#""2023"#));
}

#[test]
fn bad_patterns_and_impossible_strings_are_refused_at_their_place() {
    let e = Grammar::from_schema(&json!({"properties": {"a": {"type": "string", "pattern": "(x"}}})).unwrap_err();
    assert_eq!(e.path, "#/properties/a/pattern");
    assert!(e.why.contains("missing `)`"), "{}", e.why);
    let e = Grammar::from_schema(&json!({"type": "string", "pattern": "^a{5}$", "maxLength": 3})).unwrap_err();
    assert!(e.why.contains("no string satisfies"), "{}", e.why);
    let e = Grammar::from_schema(&json!({"type": "string", "pattern": 3})).unwrap_err();
    assert_eq!(e.path, "#/pattern");
    // Unknown formats stay annotations.
    assert!(Grammar::from_schema(&json!({"type": "string", "format": "color"})).is_ok());
}

/// `yes` are whole values of `schema` (and the validator agrees), `no` are not (they may be
/// prefixes of some), and each of `dead` dies at its last byte.
fn check(schema: Json, yes: &[&str], no: &[&str], dead: &[&str]) {
    let gr = g(&schema);
    for d in yes {
        let mut s = State::start(&gr);
        assert!(s.feed(&gr, d.as_bytes()) && s.can_end(&gr), "{schema}: {d} must be accepted");
        // (The validator reads the newest draft, where draft 4's flags are not numbers.)
        if !schema.to_string().contains("true") {
            agrees(&schema, d);
        }
    }
    for d in no {
        let mut s = State::start(&gr);
        assert!(!(s.feed(&gr, d.as_bytes()) && s.can_end(&gr)), "{schema}: {d} must be refused");
    }
    for d in dead {
        let mut s = State::start(&gr);
        assert!(!s.feed(&gr, d.as_bytes()), "{schema}: prefix {d} must die at once");
    }
}

/// Bounded numbers: plain decimals of at most 15 digits, kept in range from the first byte (the
/// bounds read exactly as the decimals JSON writes them, exclusive ones and draft 4's flags
/// too); a number with bounds but no type is such a number.
#[test]
fn bounded_numbers_stay_in_range_from_the_first_digit() {
    check(json!({"type": "number", "minimum": 0, "maximum": 1}), &["0", "1", "0.5", "0.999", "1.000", "-0", "0.00000000000001"], &["1.0000001", "-0.1", "2", "0."], &["-1", "2", "1.1", "1.01", "0.1e", "01", "00", "0.000000000000001"]);
    check(json!({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}), &["0.5", "0.00000000000001", "0.99999999999999"], &["0", "1", "0.0", "-0"], &["1", "-", "0.00000000000000"]);
    check(json!({"type": "number", "minimum": 0.1, "maximum": 0.1}), &["0.1", "0.10"], &["0.11", "0.09", "0"], &["0.2", "0.11", "0.09", "1"]);
    check(json!({"type": "number", "minimum": -3.5, "maximum": 2.25}), &["-3.5", "-3", "0", "2.25", "-0.5"], &["-3.51", "2.26", "3"], &["-4", "-3.6", "2.3", "3", "-35"]);
    check(json!({"type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": 10, "exclusiveMaximum": true}), &["5", "9.99"], &["0", "10", "10.0"], &["10", "-"]);
    check(json!({"type": "number", "minimum": 100}), &["100", "123456789012345", "100.5"], &["99.9", "1234567890123456"], &["-", "99.9", "1234567890123456"]);
    // No type: a bounded number (so integers, and decimals too).
    check(json!({"minimum": 1.5, "maximum": 3}), &["2", "1.5", "3"], &["1", "3.5"], &["4", "1.4", "\""]);
    // Inside a document the number ends at its parent's next byte.
    check(json!({"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"], "additionalProperties": false}), &["{\"p\": 0.75}", "{\"p\":1}"], &["{\"p\": 1.5}"], &["{\"p\": 2", "{\"p\": 1.5"]);
    let e = Grammar::from_schema(&json!({"type": "number", "minimum": 1, "exclusiveMaximum": 1})).unwrap_err();
    assert!(e.why.contains("no number"), "{}", e.why);
    // Past what 15 digits can write.
    assert!(Grammar::from_schema(&json!({"type": "number", "minimum": 1e15})).unwrap_err().why.contains("no number"));
    assert_eq!(Grammar::from_schema(&json!({"properties": {"n": {"type": "number", "maximum": "1"}}})).unwrap_err().path, "#/properties/n/maximum");
}

/// Bounded integers: every prefix the matcher keeps can still end in range, and it ends only
/// there; the bounds read like JSON Schema's (exclusive ones, fractional ones, draft 4's flags).
#[test]
fn bounded_integers_stay_in_range_from_the_first_digit() {
    check(json!({"type": "integer", "minimum": 10, "maximum": 250}), &["10", "99", "250", "137", "25"], &["9", "251", "1", "2"], &["0", "-", "2500", "300", "2510"]);
    check(json!({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}), &["1", "4"], &["0", "5"], &["-", "5", "0", "10"]);
    check(json!({"type": "integer", "minimum": -3.5, "maximum": 2.5}), &["-3", "0", "-0", "2"], &["-4", "3"], &["-4", "3", "-30"]);
    check(json!({"type": "integer", "minimum": 0, "exclusiveMinimum": true}), &["1", "1000000"], &["0"], &["-", "0"]);
    check(json!({"type": "integer", "maximum": -100}), &["-100", "-9999999"], &["-99", "100"], &["0", "1", "-0"]);
    check(json!({"type": "integer", "minimum": 9223372036854775807u64}), &["9223372036854775807"], &[], &["1", "-", "92233720368547758080"]);
    // No bounds: i64's range, so every integer a call carries reads back exactly.
    check(json!({"type": "integer"}), &["0", "-0", "-9223372036854775808", "9223372036854775807", "42"], &["9223372036854775808", "-9223372036854775809"], &["01", "1.5", "1e3", "92233720368547758070", "13210321012332102123"]);
    // Inside a document, the number ends where its parent's next byte comes.
    check(json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 12}}), &["[1, 12,7]"], &["[0]", "[13]"], &["[0", "[13"]);
    let e = Grammar::from_schema(&json!({"type": "integer", "minimum": 3, "maximum": 2.5})).unwrap_err();
    assert!(e.why.contains("no integer"), "{}", e.why);
    assert_eq!(Grammar::from_schema(&json!({"properties": {"n": {"type": "integer", "minimum": "1"}}})).unwrap_err().path, "#/properties/n/minimum");
}
