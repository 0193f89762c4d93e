//! SPDK's parsed JSON (a flat array of `spdk_json_val` tokens) to `serde_json` values.
//!
//! SPDK hands an RPC handler its parameters as the token array its parser produced: a `_BEGIN`
//! token for each object or array carries the number of tokens inside it, object members are a
//! `NAME` token followed by the value's tokens, and numbers are kept as their source text. This
//! module rebuilds a [`serde_json::Value`] from such a token list; the FFI side
//! (`crate::rpc`) only copies the tokens out of SPDK's array.

use serde_json::{Map, Number, Value};
use thiserror::Error;

/// One token of SPDK's JSON parser output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// `null`
    Null,
    /// `true`
    True,
    /// `false`
    False,
    /// A number, as written.
    Number(String),
    /// A string (decoded).
    String(String),
    /// An object member name (decoded).
    Name(String),
    /// `[`, with the number of tokens up to the matching `]`.
    ArrayBegin(u32),
    /// `]`
    ArrayEnd,
    /// `{`, with the number of tokens up to the matching `}`.
    ObjectBegin(u32),
    /// `}`
    ObjectEnd,
}

/// Why a token list is not one JSON value.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// The list ended inside a value.
    #[error("truncated JSON token list")]
    Truncated,
    /// A token that cannot appear here.
    #[error("unexpected JSON token at {0}")]
    Unexpected(usize),
    /// A number that JSON does not allow.
    #[error("invalid JSON number {0:?}")]
    Number(String),
    /// Tokens left after the value.
    #[error("trailing JSON tokens after position {0}")]
    Trailing(usize),
}

/// Rebuilds the single value that `tokens` hold.
pub fn tokens_to_value(tokens: &[Token]) -> Result<Value, JsonError> {
    let (v, next) = value_at(tokens, 0, 0)?;
    if next != tokens.len() {
        return Err(JsonError::Trailing(next));
    }
    Ok(v)
}

/// Deepest nesting accepted (SPDK's parser is not recursive; this converter is).
const MAX_DEPTH: usize = 128;

fn value_at(t: &[Token], i: usize, depth: usize) -> Result<(Value, usize), JsonError> {
    if depth > MAX_DEPTH {
        return Err(JsonError::Unexpected(i));
    }
    let tok = t.get(i).ok_or(JsonError::Truncated)?;
    Ok(match tok {
        Token::Null => (Value::Null, i + 1),
        Token::True => (Value::Bool(true), i + 1),
        Token::False => (Value::Bool(false), i + 1),
        Token::String(s) => (Value::String(s.clone()), i + 1),
        Token::Number(n) => (Value::Number(parse_number(n)?), i + 1),
        Token::ArrayBegin(_) => {
            let mut v = Vec::new();
            let mut j = i + 1;
            loop {
                match t.get(j).ok_or(JsonError::Truncated)? {
                    Token::ArrayEnd => break (Value::Array(v), j + 1),
                    Token::Name(_) | Token::ObjectEnd => return Err(JsonError::Unexpected(j)),
                    _ => {
                        let (e, n) = value_at(t, j, depth + 1)?;
                        v.push(e);
                        j = n;
                    }
                }
            }
        }
        Token::ObjectBegin(_) => {
            let mut m = Map::new();
            let mut j = i + 1;
            loop {
                match t.get(j).ok_or(JsonError::Truncated)? {
                    Token::ObjectEnd => break (Value::Object(m), j + 1),
                    Token::Name(k) => {
                        let (e, n) = value_at(t, j + 1, depth + 1)?;
                        m.insert(k.clone(), e);
                        j = n;
                    }
                    _ => return Err(JsonError::Unexpected(j)),
                }
            }
        }
        Token::Name(_) | Token::ArrayEnd | Token::ObjectEnd => {
            return Err(JsonError::Unexpected(i))
        }
    })
}

fn parse_number(n: &str) -> Result<Number, JsonError> {
    serde_json::from_str::<Number>(n).map_err(|_| JsonError::Number(n.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rebuilds_nested_values() {
        // {"ctrlr":"vhost.0","cpumask":"0x1","q":[1,-2.5e3,true,null,{"x":false}]}
        let t = vec![
            Token::ObjectBegin(15),
            Token::Name("ctrlr".into()),
            Token::String("vhost.0".into()),
            Token::Name("cpumask".into()),
            Token::String("0x1".into()),
            Token::Name("q".into()),
            Token::ArrayBegin(8),
            Token::Number("1".into()),
            Token::Number("-2.5e3".into()),
            Token::True,
            Token::Null,
            Token::ObjectBegin(2),
            Token::Name("x".into()),
            Token::False,
            Token::ObjectEnd,
            Token::ArrayEnd,
            Token::ObjectEnd,
        ];
        assert_eq!(
            tokens_to_value(&t).unwrap(),
            json!({"ctrlr": "vhost.0", "cpumask": "0x1", "q": [1, -2500.0, true, null, {"x": false}]})
        );
        assert_eq!(tokens_to_value(&[Token::Null]).unwrap(), Value::Null);
    }

    #[test]
    fn malformed_token_lists_are_errors() {
        assert_eq!(tokens_to_value(&[]), Err(JsonError::Truncated));
        assert_eq!(
            tokens_to_value(&[Token::ObjectBegin(1), Token::Name("a".into())]),
            Err(JsonError::Truncated)
        );
        assert_eq!(
            tokens_to_value(&[Token::ObjectBegin(1), Token::True, Token::ObjectEnd]),
            Err(JsonError::Unexpected(1))
        );
        assert_eq!(
            tokens_to_value(&[
                Token::ArrayBegin(1),
                Token::Name("a".into()),
                Token::ArrayEnd
            ]),
            Err(JsonError::Unexpected(1))
        );
        assert_eq!(
            tokens_to_value(&[Token::Number("01x".into())]),
            Err(JsonError::Number("01x".into()))
        );
        assert_eq!(
            tokens_to_value(&[Token::Null, Token::Null]),
            Err(JsonError::Trailing(1))
        );
        assert_eq!(
            tokens_to_value(&[Token::ArrayEnd]),
            Err(JsonError::Unexpected(0))
        );
        let mut deep = vec![Token::ArrayBegin(0); 200];
        deep.extend(vec![Token::ArrayEnd; 200]);
        assert!(tokens_to_value(&deep).is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_token_lists_never_panic(kinds in proptest::collection::vec(0u8..10, 0..40)) {
            let t: Vec<Token> = kinds.iter().map(|k| match k {
                0 => Token::Null, 1 => Token::True, 2 => Token::False,
                3 => Token::Number("7".into()), 4 => Token::String("s".into()),
                5 => Token::Name("n".into()), 6 => Token::ArrayBegin(0), 7 => Token::ArrayEnd,
                8 => Token::ObjectBegin(0), _ => Token::ObjectEnd,
            }).collect();
            let _ = tokens_to_value(&t);
        }
    }
}
