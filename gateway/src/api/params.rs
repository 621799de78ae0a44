//! Reading request fields with errors that name the field, and the fields shared by
//! completions and chat: sampling, `n`, `stop`, `stream`, `max_tokens`.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

use super::error::ApiError;
use crate::engine::SamplingParams;

/// JSON type name for messages.
pub fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// A request object; remembers which fields were read so the rest can be logged as unknown.
pub struct Fields<'a> {
    obj: &'a Map<String, Json>,
    seen: Vec<&'static str>,
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Json>) -> Self {
        Fields { obj, seen: Vec::new() }
    }

    /// The raw value; `null` counts as absent (OpenAI clients send explicit nulls).
    pub fn get(&mut self, key: &'static str) -> Option<&'a Json> {
        self.seen.push(key);
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// Fields the server does not know (ignored; logged at debug).
    pub fn unknown(&self) -> Vec<String> {
        self.obj.keys().filter(|k| !self.seen.contains(&k.as_str())).cloned().collect()
    }

    pub fn bool(&mut self, key: &'static str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(key, format!("must be a boolean, got {}", type_name(v)))),
        }
    }

    pub fn string(&mut self, key: &'static str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(key, format!("must be a string, got {}", type_name(v)))),
        }
    }

    /// A finite number in `[lo, hi]`.
    pub fn number(&mut self, key: &'static str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(x >= lo && x <= hi) {
                    let range = if hi == f64::MAX { format!(">= {lo}") } else { format!("between {lo} and {hi}") };
                    return Err(ApiError::invalid(key, format!("must be {range}, got {x}")));
                }
                Ok(Some(x))
            }
            Some(v) => Err(ApiError::invalid(key, format!("must be a number, got {}", type_name(v)))),
        }
    }

    /// An integer in `[lo, hi]`.
    pub fn integer(&mut self, key: &'static str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Json::Number(n)) => {
                let x = n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15).map(|f| f as i64));
                let Some(x) = x else {
                    return Err(ApiError::invalid(key, format!("must be an integer, got {n}")));
                };
                if x < lo || x > hi {
                    let range = if hi == i64::MAX { format!(">= {lo}") } else { format!("between {lo} and {hi}") };
                    return Err(ApiError::invalid(key, format!("must be {range}, got {x}")));
                }
                Ok(Some(x))
            }
            Some(v) => Err(ApiError::invalid(key, format!("must be an integer, got {}", type_name(v)))),
        }
    }
}

/// `seed`: any 64-bit integer, signed or not (a negative one wraps; both read as the same
/// 64 bits the sampler seeds from).
fn seed(f: &mut Fields<'_>) -> Result<Option<u64>, ApiError> {
    if let Some(Json::Number(n)) = f.obj.get("seed")
        && let Some(u) = n.as_u64()
    {
        f.get("seed");
        return Ok(Some(u));
    }
    Ok(f.integer("seed", i64::MIN, i64::MAX)?.map(|x| x as u64))
}

/// Which endpoint reads the fields (they differ in `logprobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// Fields shared by completions and chat, validated.
#[derive(Debug, Clone)]
pub struct CommonParams {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub n: u32,
    /// `None`: the rest of the context.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// vLLM extension: keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
}

/// Most top-logprobs the engine returns.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Reads and validates the shared fields.
pub fn common(f: &mut Fields<'_>, ep: Endpoint, defaults: &SamplingParams, max_n: u32, vocab: usize) -> Result<CommonParams, ApiError> {
    let model = f.string("model")?.map(str::to_string);
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Json::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid("stream_options", "is only allowed when `stream` is true"));
            }
            match o.get("include_usage") {
                None | Some(Json::Null) => false,
                Some(Json::Bool(b)) => *b,
                Some(v) => {
                    return Err(ApiError::invalid(
                        "stream_options.include_usage",
                        format!("must be a boolean, got {}", type_name(v)),
                    ));
                }
            }
        }
        Some(v) => return Err(ApiError::invalid("stream_options", format!("must be an object, got {}", type_name(v)))),
    };
    let n = f.integer("n", 1, max_n as i64)?.unwrap_or(1) as u32;
    if let Some(b) = f.integer("best_of", 1, max_n as i64)?
        && b as u32 != n
    {
        return Err(ApiError::unsupported("best_of", "is not supported (only best_of equal to n)"));
    }
    let mut max_tokens = f.integer("max_tokens", 1, u32::MAX as i64)?.map(|x| x as u32);
    if ep == Endpoint::Chat
        && let Some(m) = f.integer("max_completion_tokens", 1, u32::MAX as i64)?
    {
        max_tokens = Some(m as u32);
    }
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(a)) => string_array("stop", a, 4)?,
        Some(v) => {
            return Err(ApiError::invalid("stop", format!("must be a string or an array of strings, got {}", type_name(v))));
        }
    };

    let mut s = defaults.clone();
    temperature_top_p_top_k(f, &mut s, 2.0)?;
    if let Some(p) = f.number("min_p", 0.0, 1.0)? {
        s.min_p = p as f32;
    }
    if let Some(p) = f.number("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p as f32;
    }
    if let Some(p) = f.number("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p as f32;
    }
    if let Some(p) = f.number("repetition_penalty", 0.0, f64::MAX)? {
        if p == 0.0 {
            return Err(ApiError::invalid("repetition_penalty", "must be greater than 0"));
        }
        s.repetition_penalty = p as f32;
    }
    s.seed = seed(f)?;
    s.logit_bias = logit_bias(f.get("logit_bias"), vocab)?;
    match ep {
        Endpoint::Chat => {
            s.logprobs = f.bool("logprobs")?.unwrap_or(false);
            if let Some(k) = f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)? {
                if !s.logprobs && k > 0 {
                    return Err(ApiError::invalid("top_logprobs", "requires `logprobs` to be true"));
                }
                s.top_logprobs = k as u32;
            }
        }
        Endpoint::Completions => {
            // Completions: `logprobs` is the number of alternatives (0..=20); 0 still returns
            // the sampled token's logprob.
            if let Some(k) = f.integer("logprobs", 0, MAX_TOP_LOGPROBS)? {
                s.logprobs = true;
                s.top_logprobs = k as u32;
            }
        }
    }
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    // Accepted and ignored: they do not change the output.
    for k in ["user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"] {
        let _ = f.get(k);
    }
    Ok(CommonParams { model, stream, include_usage, n, max_tokens, stop, sampling: s, ignore_eos })
}

/// `temperature` (0..`max_temperature`), `top_p` ((0, 1]) and `top_k` (an integer; -1 or 0 =
/// off) into `s`.
pub fn temperature_top_p_top_k(f: &mut Fields<'_>, s: &mut SamplingParams, max_temperature: f64) -> Result<(), ApiError> {
    if let Some(t) = f.number("temperature", 0.0, max_temperature)? {
        s.temperature = t as f32;
    }
    if let Some(p) = f.number("top_p", 0.0, 1.0)? {
        if p == 0.0 {
            return Err(ApiError::invalid("top_p", "must be greater than 0"));
        }
        s.top_p = p as f32;
    }
    if let Some(k) = f.integer("top_k", -1, i64::from(u32::MAX))? {
        s.top_k = if k < 0 { 0 } else { k as u32 };
    }
    Ok(())
}

/// An array of at most `max` strings (stop strings), each error naming `key[i]`.
pub fn string_array(key: &str, a: &[Json], max: usize) -> Result<Vec<String>, ApiError> {
    if a.len() > max {
        return Err(ApiError::invalid(key, format!("takes at most {max} strings, got {}", a.len())));
    }
    a.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Json::String(s) => Ok(s.clone()),
            v => Err(ApiError::invalid(format!("{key}[{i}]"), format!("must be a string, got {}", type_name(v)))),
        })
        .collect()
}

fn logit_bias(v: Option<&Json>, vocab: usize) -> Result<HashMap<u32, f32>, ApiError> {
    let Some(v) = v else { return Ok(HashMap::new()) };
    let Json::Object(m) = v else {
        return Err(ApiError::invalid("logit_bias", format!("must be an object of token id -> bias, got {}", type_name(v))));
    };
    let mut out = HashMap::new();
    for (k, b) in m {
        let param = format!("logit_bias.{k}");
        let id: u32 = k.parse().map_err(|_| ApiError::invalid(&param, "keys must be token ids (integers as strings)"))?;
        if id as usize >= vocab {
            return Err(ApiError::invalid(&param, format!("token id {id} is out of range (vocabulary size {vocab})")));
        }
        let x = b.as_f64().ok_or_else(|| ApiError::invalid(&param, format!("must be a number, got {}", type_name(b))))?;
        if !(-100.0..=100.0).contains(&x) {
            return Err(ApiError::invalid(&param, format!("must be between -100 and 100, got {x}")));
        }
        out.insert(id, x as f32);
    }
    Ok(out)
}

/// Prompt forms of completions and perplexity: a string, token ids, or a list of either.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// Reads `prompt` (or `input`) as one or more prompts.
pub fn prompts(v: Option<&Json>, key: &str, vocab: usize) -> Result<Vec<PromptInput>, ApiError> {
    let Some(v) = v else { return Err(ApiError::invalid(key, "is required")) };
    let tokens = |a: &[Json], param: &str| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, t)| match t.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(ApiError::invalid(format!("{param}[{i}]"), format!("token id {id} is out of range (vocabulary size {vocab})"))),
                None => Err(ApiError::invalid(format!("{param}[{i}]"), format!("must be a token id, got {}", type_name(t)))),
            })
            .collect()
    };
    let out = match v {
        Json::String(s) => vec![PromptInput::Text(s.clone())],
        Json::Array(a) if a.is_empty() => return Err(ApiError::invalid(key, "must not be empty")),
        Json::Array(a) if a[0].is_number() => vec![PromptInput::Tokens(tokens(a, key)?)],
        Json::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Json::String(s) => Ok(PromptInput::Text(s.clone())),
                Json::Array(t) => Ok(PromptInput::Tokens(tokens(t, &format!("{key}[{i}]"))?)),
                other => Err(ApiError::invalid(
                    format!("{key}[{i}]"),
                    format!("must be a string or an array of token ids, got {}", type_name(other)),
                )),
            })
            .collect::<Result<_, _>>()?,
        other => {
            return Err(ApiError::invalid(
                key,
                format!("must be a string, an array of token ids, or an array of either, got {}", type_name(other)),
            ));
        }
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Json, ep: Endpoint) -> Result<CommonParams, ApiError> {
        let obj = v.as_object().unwrap().clone();
        let mut f = Fields::new(&obj);
        common(&mut f, ep, &SamplingParams::default(), 8, 1000)
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"n": 0}), "n"),
            (json!({"n": 9}), "n"),
            (json!({"max_tokens": -1}), "max_tokens"),
            (json!({"max_tokens": 1.5}), "max_tokens"),
            (json!({"stop": ["a", 1]}), "stop[1]"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias.x"),
            (json!({"logit_bias": {"5000": 1}}), "logit_bias.5000"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias.5"),
            (json!({"stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"stream": true, "stream_options": {"include_usage": 1}}), "stream_options.include_usage"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
            (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"seed": "x"}), "seed"),
        ];
        for (v, param) in cases {
            let e = parse(v.clone(), Endpoint::Chat).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{v}");
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
            assert!(e.message.starts_with(param), "{}", e.message);
        }
    }

    #[test]
    fn values_and_defaults() {
        let p = parse(
            json!({"model": "m", "temperature": 0, "top_k": -1, "stop": "x", "n": 2, "seed": -1,
                   "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 2, "logit_bias": {"3": -100},
                   "stream": true, "stream_options": {"include_usage": true}, "user": null, "foo": 1}),
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_k, 0);
        assert_eq!(p.sampling.top_p, 0.95);
        assert_eq!(p.sampling.seed, Some(u64::MAX));
        let big = parse(json!({"seed": u64::MAX - 1}), Endpoint::Chat).unwrap();
        assert_eq!(big.sampling.seed, Some(u64::MAX - 1));
        let e = parse(json!({"seed": 18446744073709551616.0f64}), Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("seed"));
        assert_eq!(p.stop, vec!["x"]);
        assert_eq!(p.max_tokens, Some(7));
        assert!(p.include_usage && p.stream);
        assert_eq!(p.sampling.logit_bias.get(&3), Some(&-100.0));
        let c = parse(json!({"logprobs": 3}), Endpoint::Completions).unwrap();
        assert!(c.sampling.logprobs);
        assert_eq!(c.sampling.top_logprobs, 3);
    }

    #[test]
    fn prompt_forms() {
        assert_eq!(prompts(Some(&json!("hi")), "prompt", 10).unwrap(), vec![PromptInput::Text("hi".into())]);
        assert_eq!(prompts(Some(&json!([1, 2])), "prompt", 10).unwrap(), vec![PromptInput::Tokens(vec![1, 2])]);
        assert_eq!(
            prompts(Some(&json!(["a", [3]])), "prompt", 10).unwrap(),
            vec![PromptInput::Text("a".into()), PromptInput::Tokens(vec![3])]
        );
        assert_eq!(prompts(Some(&json!([1, 20])), "prompt", 10).unwrap_err().param.as_deref(), Some("prompt[1]"));
        assert_eq!(prompts(Some(&json!(["a", [1, "x"]])), "prompt", 10).unwrap_err().param.as_deref(), Some("prompt[1][1]"));
        assert_eq!(prompts(Some(&json!(5)), "prompt", 10).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(prompts(None, "prompt", 10).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(prompts(Some(&json!([])), "prompt", 10).unwrap_err().param.as_deref(), Some("prompt"));
    }
}
