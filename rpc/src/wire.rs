//! JSON-RPC 2.0 envelopes and a streaming decoder for SPDK's socket framing.
//!
//! SPDK does not frame messages: clients write JSON objects back to back (SPDK's python
//! client pretty-prints them over several lines; others send no newline at all), a read may
//! end in the middle of an object, and one read may hold several pipelined requests.
//! [`StreamDecoder`] finds the end of each top-level JSON value by scanning brackets and
//! strings, then hands the slice to `serde_json`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

pub use crate::error::{codes, SpdkError};

/// Default maximum size of one JSON message: 64 MiB.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// Buffer capacity a [`StreamDecoder`] keeps across messages (more is given back by
/// [`StreamDecoder::release`]).
const RETAINED_CAPACITY: usize = 64 * 1024;

/// A request id: number, string, or an explicit `null`.
///
/// A request without any `id` member is a notification (`Option<Id>::None` in [`Request`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Id {
    /// A numeric id (SPDK's clients count up from 1).
    Number(Number),
    /// A numeric id that [`Number`] cannot hold exactly (beyond 64 bits, a fraction or an
    /// exponent), kept as the literal text received so that the reply echoes it byte for byte
    /// (a float would not: `123456789012345678901234` would come back as `1.2345678901234568e23`).
    Exact(String),
    /// A string id.
    String(String),
    /// `"id": null` (also used in replies to requests whose id could not be read).
    Null,
}

impl Serialize for Id {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Id::Number(n) => n.serialize(s),
            Id::Exact(text) => match serde_json::value::RawValue::from_string(text.clone()) {
                Ok(raw) => raw.serialize(s),
                Err(e) => Err(serde::ser::Error::custom(e)),
            },
            Id::String(t) => s.serialize_str(t),
            Id::Null => s.serialize_unit(),
        }
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Number(n) => Ok(Id::Number(n)),
            Value::String(t) => Ok(Id::String(t)),
            Value::Null => Ok(Id::Null),
            other => Err(serde::de::Error::custom(format!(
                "id must be a number, a string or null, not {other}"
            ))),
        }
    }
}

impl Id {
    /// `self` with a float-typed number replaced by its literal text from `frame`, the raw
    /// bytes of the message it was read from (see [`Id::Exact`]).
    pub fn exact_in(self, frame: &[u8]) -> Self {
        #[derive(Deserialize)]
        struct RawId<'a> {
            #[serde(borrow)]
            id: Option<&'a serde_json::value::RawValue>,
        }
        match self {
            Id::Number(n) if n.is_f64() => match serde_json::from_slice::<RawId<'_>>(frame) {
                Ok(RawId { id: Some(raw) }) => Id::Exact(raw.get().to_owned()),
                _ => Id::Number(n),
            },
            other => other,
        }
    }
}

impl From<u64> for Id {
    fn from(n: u64) -> Self {
        Id::Number(n.into())
    }
}

impl From<&str> for Id {
    fn from(s: &str) -> Self {
        Id::String(s.to_owned())
    }
}

/// A JSON-RPC request (or, with `id: None`, a notification).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Always `"2.0"` when we send; SPDK accepts requests without it, and so do we.
    #[serde(default = "jsonrpc_version")]
    pub jsonrpc: String,
    /// Method name.
    pub method: String,
    /// Request id; `None` for a notification.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deser_id"
    )]
    pub id: Option<Id>,
    /// Parameters (SPDK only uses objects). Omitted when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Value>,
}

fn jsonrpc_version() -> String {
    "2.0".to_owned()
}

/// Distinguish `"id": null` (Some(Id::Null)) from a missing id (None).
fn deser_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Id>, D::Error> {
    Id::deserialize(d).map(Some)
}

impl Request {
    /// A request with an id.
    pub fn new(method: impl Into<String>, id: Id, params: Option<Value>) -> Self {
        Self {
            jsonrpc: jsonrpc_version(),
            method: method.into(),
            id: Some(id),
            params,
        }
    }

    /// A notification (no id, no reply expected).
    pub fn notification(method: impl Into<String>, params: Option<Value>) -> Self {
        Self {
            jsonrpc: jsonrpc_version(),
            method: method.into(),
            id: None,
            params,
        }
    }

    /// True if this request has no id and so gets no reply.
    pub fn is_notification(&self) -> bool {
        self.id.is_none()
    }

    /// Validate a decoded JSON value as a request, the way the server does.
    ///
    /// On failure returns the `-32600` error and, if it could be read, the id to answer with.
    pub fn from_value(v: Value) -> Result<Self, Box<InvalidRequest>> {
        let mut obj = match v {
            Value::Object(o) => o,
            Value::Array(_) => {
                return Err(Box::new(InvalidRequest::new(
                    None,
                    SpdkError::invalid_request("Invalid request: batch requests are not supported"),
                )))
            }
            _ => {
                return Err(Box::new(InvalidRequest::new(
                    None,
                    SpdkError::invalid_request("Invalid request: not a JSON object"),
                )))
            }
        };
        let id = match obj.remove("id") {
            None => None,
            Some(Value::Null) => Some(Id::Null),
            Some(Value::Number(n)) => Some(Id::Number(n)),
            Some(Value::String(s)) => Some(Id::String(s)),
            Some(_) => {
                return Err(Box::new(InvalidRequest::new(
                    Some(Id::Null),
                    SpdkError::invalid_request("Invalid request: id must be a number or string"),
                )))
            }
        };
        let bad = |msg: &str| {
            Err(Box::new(InvalidRequest::new(
                id.clone(),
                SpdkError::invalid_request(format!("Invalid request: {msg}")),
            )))
        };
        match obj.remove("jsonrpc") {
            None => {}
            Some(Value::String(s)) if s == "2.0" => {}
            Some(_) => return bad("jsonrpc must be \"2.0\""),
        }
        let method = match obj.remove("method") {
            Some(Value::String(s)) => s,
            Some(_) => return bad("method must be a string"),
            None => return bad("missing method"),
        };
        let params = match obj.remove("params") {
            None => None,
            Some(p @ (Value::Object(_) | Value::Array(_))) => Some(p),
            Some(Value::Null) => None,
            Some(_) => return bad("params must be an object"),
        };
        if let Some(k) = obj.keys().next() {
            return bad(&format!("unexpected member {k:?}"));
        }
        Ok(Self {
            jsonrpc: jsonrpc_version(),
            method,
            id,
            params,
        })
    }
}

impl Request {
    /// [`from_value`](Self::from_value) for a value decoded from `frame`, its raw bytes: a
    /// numeric id that does not fit a 64-bit integer keeps its exact literal ([`Id::Exact`]).
    pub fn from_message(v: Value, frame: &[u8]) -> Result<Self, Box<InvalidRequest>> {
        match Self::from_value(v) {
            Ok(mut r) => {
                r.id = r.id.map(|id| id.exact_in(frame));
                Ok(r)
            }
            Err(mut bad) => {
                bad.id = bad.id.map(|id| id.exact_in(frame));
                Err(bad)
            }
        }
    }
}

/// Why a JSON value is not a valid request, and the id to answer with (`None`: use `null`).
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidRequest {
    /// The request's id, if it could be read.
    pub id: Option<Id>,
    /// The `-32600` error to answer with.
    pub error: SpdkError,
}

impl InvalidRequest {
    fn new(id: Option<Id>, error: SpdkError) -> Self {
        Self { id, error }
    }
}

/// A JSON-RPC response: `{"jsonrpc":"2.0","id":..,"result":..}` or `..,"error":{..}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The id of the request answered (`Id::Null` if it could not be read).
    pub id: Id,
    /// The result or the error.
    pub payload: Result<Value, SpdkError>,
}

impl Response {
    /// A success reply.
    pub fn result(id: Id, result: Value) -> Self {
        Self {
            id,
            payload: Ok(result),
        }
    }

    /// An error reply.
    pub fn error(id: Id, error: SpdkError) -> Self {
        Self {
            id,
            payload: Err(error),
        }
    }

    /// Serialize as SPDK does: members in the order `jsonrpc, id, result|error`, followed by
    /// a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        // Serializing a Value-based struct cannot fail: all keys are strings.
        if serde_json::to_writer(&mut out, self).is_err() {
            out.clear();
            out.extend_from_slice(br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"Internal error"}}"#);
        }
        out.push(b'\n');
        out
    }

    /// Decode a reply from a JSON value.
    pub fn from_value(v: Value) -> Result<Self, String> {
        let mut obj = match v {
            Value::Object(o) => o,
            other => {
                return Err(format!(
                    "reply is not a JSON object: {}",
                    truncate(&other.to_string())
                ))
            }
        };
        let id = match obj.remove("id") {
            None | Some(Value::Null) => Id::Null,
            Some(Value::Number(n)) => Id::Number(n),
            Some(Value::String(s)) => Id::String(s),
            Some(other) => return Err(format!("reply id is not a number or string: {other}")),
        };
        let payload = match (obj.remove("result"), obj.remove("error")) {
            (_, Some(e)) => Err(serde_json::from_value::<SpdkError>(e)
                .map_err(|e| format!("bad error object: {e}"))?),
            (Some(r), None) => Ok(r),
            (None, None) => return Err("reply has neither result nor error".to_owned()),
        };
        Ok(Self { id, payload })
    }
}

impl Serialize for Response {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("jsonrpc", "2.0")?;
        m.serialize_entry("id", &self.id)?;
        match &self.payload {
            Ok(r) => m.serialize_entry("result", r)?,
            Err(e) => m.serialize_entry("error", e)?,
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Response {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Response::from_value(v).map_err(serde::de::Error::custom)
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= 200 {
        return s.to_owned();
    }
    let mut end = 200;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Serialize `params` as SPDK's python client does: `null`, `()` and `{}` mean "no params"
/// and the member is omitted.
pub fn params_value<P: Serialize>(params: &P) -> Result<Option<Value>, serde_json::Error> {
    let v = serde_json::to_value(params)?;
    Ok(match v {
        Value::Null => None,
        Value::Object(ref o) if o.is_empty() => None,
        v => Some(v),
    })
}

/// Parse request params into a typed struct, turning serde errors into `-32602` with the
/// offending field named, e.g. `Invalid parameters: name: invalid type: integer `7`, expected a
/// string`.
///
/// Missing params are treated as `{}`, so structs whose fields are all optional accept them.
/// Positional (array) params are rejected: SPDK only takes named params.
pub fn typed<P: serde::de::DeserializeOwned>(params: Option<Value>) -> Result<P, SpdkError> {
    let v = match params {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(v @ Value::Object(_)) => v,
        Some(_) => {
            return Err(SpdkError::invalid_params(
                "Invalid parameters: params must be an object",
            ))
        }
    };
    serde_path_to_error::deserialize::<_, P>(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            SpdkError::invalid_params(format!("Invalid parameters: {inner}"))
        } else {
            SpdkError::invalid_params(format!("Invalid parameters: {path}: {inner}"))
        }
    })
}

/// Why [`StreamDecoder`] cannot go on. After either error the stream cannot be
/// resynchronized: the decoder stays failed and the connection should be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not valid JSON.
    #[error("parse error: {0}")]
    Parse(String),
    /// One message grew past the size limit before it ended.
    #[error("message exceeds the maximum size of {limit} bytes")]
    TooLarge {
        /// The configured limit.
        limit: usize,
    },
}

/// Incremental scan state of the value being framed.
#[derive(Debug, Clone, Copy, Default)]
struct Scan {
    /// Offset (from `start`) up to which bytes have been scanned.
    pos: usize,
    /// Bracket depth; 0 before the value starts.
    depth: usize,
    /// Whether the value has begun (first non-whitespace byte seen).
    started: bool,
    /// Top-level scalar (number/literal) rather than a container or string.
    scalar: bool,
    in_string: bool,
    escape: bool,
}

/// Splits a byte stream into JSON values without relying on newlines.
///
/// Feed bytes with [`feed`](Self::feed) as they arrive and pull complete values with
/// [`next_value`](Self::next_value) until it returns `Ok(None)`. Scanning is incremental, so a
/// large message arriving in many small reads costs linear time. A message larger than the
/// limit fails with [`DecodeError::TooLarge`] as soon as the limit is crossed, without
/// buffering the rest.
#[derive(Debug)]
pub struct StreamDecoder {
    buf: Vec<u8>,
    /// Start of the not-yet-consumed part of `buf`.
    start: usize,
    scan: Scan,
    max: usize,
    failed: Option<DecodeError>,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_MESSAGE_SIZE)
    }
}

impl StreamDecoder {
    /// A decoder that accepts messages of at most `max_message_size` bytes.
    pub fn new(max_message_size: usize) -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            scan: Scan::default(),
            max: max_message_size.max(1),
            failed: None,
        }
    }

    /// The message size limit.
    pub fn max_message_size(&self) -> usize {
        self.max
    }

    /// Append received bytes.
    ///
    /// Bytes already returned as values are dropped first, and the buffer grows by doubling
    /// but never past what one message of the maximum size needs, so its allocation is what
    /// [`memory_after_feed`](Self::memory_after_feed) predicts.
    pub fn feed(&mut self, data: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        self.drop_consumed();
        let cap = self.grown_capacity(data.len());
        if cap > self.buf.capacity() {
            self.buf.reserve_exact(cap - self.buf.len());
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes allocated for buffering now.
    pub fn memory(&self) -> usize {
        self.buf.capacity()
    }

    /// Bytes that will be allocated for buffering after [`feed`](Self::feed)ing `n` more bytes.
    /// A server uses it to check a memory budget before it accepts more of a message.
    pub fn memory_after_feed(&self, n: usize) -> usize {
        if self.failed.is_some() {
            return self.buf.capacity();
        }
        self.grown_capacity(n).max(self.buf.capacity())
    }

    /// Give back memory no longer needed: bytes already returned as values, and spare
    /// capacity beyond twice what the value being received holds (a connection that sent one
    /// large message does not keep its buffer).
    pub fn release(&mut self) {
        self.drop_consumed();
        let len = self.buf.len();
        if self.buf.capacity() > RETAINED_CAPACITY && len.saturating_mul(4) < self.buf.capacity() {
            self.buf
                .shrink_to(len.saturating_mul(2).max(RETAINED_CAPACITY));
        }
    }

    fn drop_consumed(&mut self) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
    }

    /// The capacity `feed(n)` grows the buffer to (after consumed bytes are dropped).
    fn grown_capacity(&self, n: usize) -> usize {
        let cap = self.buf.capacity();
        let need = self.buf.len() - self.start + n;
        if need <= cap {
            return cap;
        }
        let doubled = cap.saturating_mul(2).min(self.max.saturating_add(1));
        need.max(doubled)
    }

    /// Bytes received but not yet returned as values (including whitespace).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// True if the buffered bytes hold part of a value (not just whitespace).
    pub fn has_partial(&self) -> bool {
        self.buf[self.start..]
            .iter()
            .any(|b| !b.is_ascii_whitespace())
    }

    /// The next complete value, `Ok(None)` if more bytes are needed.
    pub fn next_value(&mut self) -> Result<Option<Value>, DecodeError> {
        Ok(self.next_message()?.map(|(v, _)| v))
    }

    /// The next complete value with the raw bytes it was parsed from, `Ok(None)` if more
    /// bytes are needed.
    pub fn next_message(&mut self) -> Result<Option<(Value, &[u8])>, DecodeError> {
        match self.next_frame()? {
            None => Ok(None),
            Some(range) => match serde_json::from_slice::<Value>(&self.buf[range.clone()]) {
                Ok(v) => Ok(Some((v, &self.buf[range]))),
                Err(e) => Err(self.fail(DecodeError::Parse(e.to_string()))),
            },
        }
    }

    /// Signal end of stream: a value cut short is a parse error; a top-level scalar that ran
    /// to the end of the stream (e.g. `42` with no newline) is returned.
    pub fn finish(&mut self) -> Result<Option<Value>, DecodeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if !self.has_partial() {
            return Ok(None);
        }
        if self.scan.scalar {
            self.feed(b" ");
            return self.next_value();
        }
        Err(self.fail(DecodeError::Parse("EOF while parsing a value".to_owned())))
    }

    fn fail(&mut self, e: DecodeError) -> DecodeError {
        self.failed = Some(e.clone());
        self.buf = Vec::new();
        self.start = 0;
        e
    }

    /// Find the byte range of the next complete top-level value.
    fn next_frame(&mut self) -> Result<Option<std::ops::Range<usize>>, DecodeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if !self.scan.started {
            let data = &self.buf[self.start..];
            let ws = data.iter().take_while(|b| b.is_ascii_whitespace()).count();
            self.start += ws;
            if ws == data.len() {
                return Ok(None);
            }
        }
        self.scan_value()
    }

    fn scan_value(&mut self) -> Result<Option<std::ops::Range<usize>>, DecodeError> {
        let data = &self.buf[self.start..];
        let mut s = self.scan;
        let mut i = s.pos;
        if !s.started {
            s.started = true;
            match data[0] {
                b'{' | b'[' => {
                    s.depth = 1;
                }
                b'"' => {
                    s.in_string = true;
                }
                b']' | b'}' | b',' | b':' => {
                    let c = data[0] as char;
                    return Err(
                        self.fail(DecodeError::Parse(format!("unexpected character {c:?}")))
                    );
                }
                _ => s.scalar = true,
            }
            i = 1;
        }
        let mut end = None;
        while i < data.len() {
            let b = data[i];
            if s.in_string {
                if s.escape {
                    s.escape = false;
                } else if b == b'\\' {
                    s.escape = true;
                } else if b == b'"' {
                    s.in_string = false;
                    if s.depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
            } else if s.scalar {
                if b.is_ascii_whitespace()
                    || matches!(b, b'{' | b'[' | b']' | b'}' | b'"' | b',' | b':')
                {
                    end = Some(i);
                    break;
                }
            } else {
                match b {
                    b'"' => s.in_string = true,
                    b'{' | b'[' => s.depth += 1,
                    b'}' | b']' => {
                        s.depth -= 1;
                        if s.depth == 0 {
                            end = Some(i + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            i += 1;
            if i > self.max {
                return Err(self.fail(DecodeError::TooLarge { limit: self.max }));
            }
        }
        match end {
            Some(len) => {
                if len > self.max {
                    return Err(self.fail(DecodeError::TooLarge { limit: self.max }));
                }
                let range = self.start..self.start + len;
                self.start += len;
                self.scan = Scan::default();
                Ok(Some(range))
            }
            None => {
                s.pos = i;
                self.scan = s;
                if i > self.max {
                    return Err(self.fail(DecodeError::TooLarge { limit: self.max }));
                }
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn all(d: &mut StreamDecoder) -> Vec<Value> {
        let mut out = vec![];
        while let Some(v) = d.next_value().unwrap() {
            out.push(v);
        }
        out
    }

    #[test]
    fn back_to_back_without_newlines() {
        let mut d = StreamDecoder::default();
        d.feed(br#"{"a":1}{"b":"}{"}  [1,[2]]"x\"y" 12 "#);
        assert_eq!(
            all(&mut d),
            vec![
                json!({"a":1}),
                json!({"b":"}{"}),
                json!([1, [2]]),
                json!("x\"y"),
                json!(12)
            ]
        );
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn partial_reads() {
        let msg = br#"{"jsonrpc":"2.0","method":"m","id":1,"params":{"s":"a\\\"}"}}"#;
        let mut d = StreamDecoder::default();
        for b in msg.iter() {
            assert!(d.next_value().unwrap().is_none());
            d.feed(&[*b]);
        }
        let v = d.next_value().unwrap().unwrap();
        assert_eq!(v["params"]["s"], "a\\\"}");
    }

    #[test]
    fn invalid_json_is_parse_error_and_sticky() {
        let mut d = StreamDecoder::default();
        d.feed(br#"{"jsonrpc":"2.0","id":3,"method":]}"#);
        assert!(matches!(d.next_value(), Err(DecodeError::Parse(_))));
        d.feed(b"{}");
        assert!(d.next_value().is_err());
    }

    #[test]
    fn too_large() {
        let mut d = StreamDecoder::new(16);
        d.feed(br#"{"a":"0123456789abcdef"}"#);
        assert_eq!(d.next_value(), Err(DecodeError::TooLarge { limit: 16 }));
        let mut d = StreamDecoder::new(16);
        d.feed(br#"{"a":"0123"#);
        assert_eq!(d.next_value(), Ok(None));
        d.feed(br#"456789abcdefghijklmn"#);
        assert_eq!(d.next_value(), Err(DecodeError::TooLarge { limit: 16 }));
        // Exactly at the limit is fine.
        let mut d = StreamDecoder::new(7);
        d.feed(br#"{"a":1}"#);
        assert_eq!(d.next_value(), Ok(Some(json!({"a":1}))));
    }

    #[test]
    fn memory_is_predicted_bounded_and_given_back() {
        let mut d = StreamDecoder::new(1 << 20);
        let mut msg = br#"{"s":""#.to_vec();
        msg.resize(600_000, b'x');
        for chunk in msg.chunks(4096) {
            let want = d.memory_after_feed(chunk.len());
            d.feed(chunk);
            assert_eq!(d.memory(), want);
            // Never more than the limit plus one read, whatever doubling would give.
            assert!(d.memory() <= (1 << 20) + 4096, "{}", d.memory());
        }
        d.feed(br#""}{"a":1}"#);
        assert!(d.next_value().unwrap().is_some());
        assert_eq!(d.next_value().unwrap(), Some(json!({"a":1})));
        d.release();
        assert!(d.memory() <= RETAINED_CAPACITY, "{}", d.memory());
        // A partial message keeps what it needs.
        d.feed(&msg);
        d.release();
        assert!(d.memory() >= msg.len());
        assert_eq!(d.next_value(), Ok(None));
    }

    #[test]
    fn exact_ids_keep_their_literal() {
        let frame = br#"{"id":123456789012345678901234,"method":"m"}"#;
        let v: Value = serde_json::from_slice(frame).unwrap();
        let r = Request::from_message(v, frame).unwrap();
        assert_eq!(r.id, Some(Id::Exact("123456789012345678901234".into())));
        let out = Response::result(r.id.unwrap(), json!(true)).to_bytes();
        assert_eq!(
            out,
            b"{\"jsonrpc\":\"2.0\",\"id\":123456789012345678901234,\"result\":true}\n"
        );
        // Integers that fit stay numbers.
        let frame = br#"{"id":18446744073709551615,"method":"m"}"#;
        let v: Value = serde_json::from_slice(frame).unwrap();
        let r = Request::from_message(v, frame).unwrap();
        assert_eq!(r.id, Some(Id::from(u64::MAX)));
    }

    #[test]
    fn finish_reports_truncation() {
        let mut d = StreamDecoder::default();
        d.feed(br#"{"jsonrpc":"2.0","id":3,"meth"#);
        assert_eq!(d.next_value(), Ok(None));
        assert!(matches!(d.finish(), Err(DecodeError::Parse(_))));
        let mut d = StreamDecoder::default();
        d.feed(b" 42");
        assert_eq!(d.next_value(), Ok(None));
        assert_eq!(d.finish(), Ok(Some(json!(42))));
    }

    #[test]
    fn request_validation() {
        let r = Request::from_value(json!({"id":4,"method":"spdk_get_version"})).unwrap();
        assert_eq!(r.id, Some(Id::from(4)));
        assert!(Request::from_value(json!({"method":"x"}))
            .unwrap()
            .is_notification());
        assert_eq!(
            Request::from_value(json!({"id":null,"method":"x"}))
                .unwrap()
                .id,
            Some(Id::Null)
        );
        let e = Request::from_value(json!({"id":"a","method":5})).unwrap_err();
        assert_eq!(e.id, Some(Id::from("a")));
        assert_eq!(e.error.code, codes::INVALID_REQUEST);
        let e = Request::from_value(json!([{"id":1,"method":"x"}])).unwrap_err();
        assert_eq!(e.error.code, codes::INVALID_REQUEST);
        assert!(Request::from_value(json!({"id":1,"method":"x","params":3})).is_err());
    }

    #[test]
    fn response_format_matches_spdk() {
        let r = Response::error(Id::from(37), SpdkError::method_not_found());
        assert_eq!(
            String::from_utf8(r.to_bytes()).unwrap(),
            "{\"jsonrpc\":\"2.0\",\"id\":37,\"error\":{\"code\":-32601,\"message\":\"Method not found\"}}\n"
        );
        let r = Response::result(Id::from(7), json!("aio0"));
        assert_eq!(
            r.to_bytes(),
            b"{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":\"aio0\"}\n"
        );
        let back: Response = serde_json::from_slice(&r.to_bytes()).unwrap();
        assert_eq!(back, r);
        let null_result =
            Response::from_value(json!({"jsonrpc":"2.0","id":1,"result":null})).unwrap();
        assert_eq!(null_result.payload, Ok(Value::Null));
    }

    #[test]
    fn typed_names_the_field() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct P {
            name: Option<String>,
        }
        let e = typed::<P>(Some(json!({"name": 7}))).unwrap_err();
        assert_eq!(e.code, codes::INVALID_PARAMS);
        assert!(e.message.contains("name"), "{}", e.message);
        let e = typed::<P>(Some(json!({"nam": "x"}))).unwrap_err();
        assert!(e.message.contains("unknown field `nam`"), "{}", e.message);
        assert!(typed::<P>(None).is_ok());
        assert!(typed::<P>(Some(json!(["x"]))).is_err());
    }

    #[test]
    fn params_value_omits_empty() {
        assert_eq!(params_value(&()).unwrap(), None);
        assert_eq!(params_value(&json!({})).unwrap(), None);
        assert_eq!(params_value(&json!({"a":1})).unwrap(), Some(json!({"a":1})));
    }
}
