//! Server-sent events. By default exactly as OpenAI frames them: `data: {json}\n\n` per chunk,
//! a final `data: [DONE]\n\n`; an error after the stream started is sent as
//! `data: {"error":{...}}` and the stream ends without `[DONE]`. An encoder may frame its
//! chunks otherwise (the Anthropic Messages API: `event: <type>` lines, no `[DONE]`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value as Json;

use super::error::{ApiError, stream_error_event};
use super::run::{Run, Update};
use crate::engine::Usage;

/// One `data:` event.
pub fn event(v: &Json) -> Bytes {
    let mut s = String::with_capacity(128);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

/// The terminating event.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// Turns updates into chunk objects; chat, completions and messages differ.
pub trait ChunkEncoder: Send + 'static {
    /// Chunks sent before any token (chat: the role of every choice).
    fn start(&mut self) -> Vec<Json>;
    /// Chunks for one update, or an error that ends the stream.
    fn update(&mut self, u: Update) -> Result<Vec<Json>, ApiError>;
    /// The chunks sent after every choice finished (OpenAI: the usage chunk when
    /// `stream_options.include_usage` asked for it).
    fn finish(&mut self, usage: &Usage) -> Vec<Json>;
    /// One chunk on the wire (OpenAI: `data: {json}`).
    fn frame(&self, chunk: &Json) -> Bytes {
        event(chunk)
    }
    /// What ends a finished stream (OpenAI: `data: [DONE]`).
    fn end(&self) -> Option<Bytes> {
        Some(done())
    }
    /// The chunk that reports an error after the stream started.
    fn error(&self, e: &ApiError) -> Json {
        stream_error_event(e)
    }
}

struct StreamState {
    run: Run,
    enc: Box<dyn ChunkEncoder>,
    queue: VecDeque<Bytes>,
    deadline: Option<tokio::time::Instant>,
    timeout: Duration,
    ended: bool,
}

/// Answers with a stream once the run's first update came: a refusal before it (queue full,
/// ranks down) is still an HTTP status. `deadline` ends the request (also its stream).
pub async fn start(mut run: Run, enc: Box<dyn ChunkEncoder>, deadline: Option<std::time::Instant>, timeout: Option<Duration>) -> Result<Response, ApiError> {
    let first = match super::common::next_update(&mut run, deadline, timeout).await {
        Some(Ok(u)) => Some(u),
        Some(Err(e)) => return Err(e),
        None => None,
    };
    let remaining = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
    Ok(response(run, enc, first, remaining))
}

/// The streaming response. `first` is the update already taken from the run (so that an error
/// before the first token could still become an HTTP status).
pub fn response(run: Run, mut enc: Box<dyn ChunkEncoder>, first: Option<Update>, timeout: Option<Duration>) -> Response {
    let mut queue: VecDeque<Bytes> = enc.start().iter().map(|c| enc.frame(c)).collect();
    let mut st = StreamState {
        run,
        enc,
        queue: VecDeque::new(),
        deadline: timeout.map(|t| tokio::time::Instant::from_std(std::time::Instant::now()) + t),
        timeout: timeout.unwrap_or_default(),
        ended: false,
    };
    if let Some(u) = first {
        push_update(&mut st, u);
    }
    queue.append(&mut st.queue);
    st.queue = queue;
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(b) = st.queue.pop_front() {
                return Some((Ok::<_, Infallible>(b), st));
            }
            if st.ended {
                return None;
            }
            let next = match st.deadline {
                Some(d) => match tokio::time::timeout_at(d, st.run.next()).await {
                    Ok(x) => x,
                    Err(_) => {
                        let e = ApiError::timeout(st.timeout.as_secs_f64());
                        st.run.fail(&e.message);
                        Some(Err(e))
                    }
                },
                None => st.run.next().await,
            };
            match next {
                Some(Ok(u)) => push_update(&mut st, u),
                Some(Err(e)) => {
                    st.run.fail(&e.message);
                    let b = st.enc.frame(&st.enc.error(&e));
                    st.queue.push_back(b);
                    st.ended = true;
                }
                None => finish(&mut st),
            }
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

fn push_update(st: &mut StreamState, u: Update) {
    match st.enc.update(u) {
        Ok(chunks) => {
            for c in &chunks {
                let b = st.enc.frame(c);
                st.queue.push_back(b);
            }
        }
        Err(e) => {
            st.run.fail(&e.message);
            let b = st.enc.frame(&st.enc.error(&e));
            st.queue.push_back(b);
            st.ended = true;
            return;
        }
    }
    if st.run.all_done() {
        finish(st);
    }
}

fn finish(st: &mut StreamState) {
    if st.ended {
        return;
    }
    let usage = st.run.usage;
    for c in st.enc.finish(&usage) {
        let b = st.enc.frame(&c);
        st.queue.push_back(b);
    }
    if let Some(b) = st.enc.end() {
        st.queue.push_back(b);
    }
    st.ended = true;
}
