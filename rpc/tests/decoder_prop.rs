//! Property tests of the streaming decoder.
#![allow(clippy::unwrap_used)]

use katablk_rpc::wire::{DecodeError, StreamDecoder};
use proptest::prelude::*;
use serde_json::Value;

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        // Strings heavy in the characters the framer has to get right.
        proptest::string::string_regex(r#"([{}\[\]"\\:,\n ]|[a-z]|\PC){0,12}"#)
            .unwrap()
            .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((".{0,8}", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Serialize values back to back: compact or pretty, with random whitespace between (none
/// at all where the grammar allows it).
fn stream(values: &[Value], pretty: &[bool], gaps: &[usize]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let bytes = if pretty[i % pretty.len()] {
            serde_json::to_vec_pretty(v)
        } else {
            serde_json::to_vec(v)
        };
        out.extend_from_slice(&bytes.unwrap());
        let scalar = !matches!(v, Value::Object(_) | Value::Array(_) | Value::String(_));
        let mut gap = gaps[i % gaps.len()] % 4;
        if scalar && gap == 0 {
            gap = 1; // `1` then `2` would read as `12`
        }
        out.extend(std::iter::repeat_n(b" \n\t\r"[gap % 4], gap));
    }
    out
}

/// Feed `bytes` split at `cuts`; return decoded values and the final error, if any.
fn decode_split(bytes: &[u8], cuts: &[usize], max: usize) -> (Vec<Value>, Option<DecodeError>) {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    points.dedup();
    let mut d = StreamDecoder::new(max);
    let mut out = Vec::new();
    for w in points.windows(2) {
        d.feed(&bytes[w[0]..w[1]]);
        loop {
            match d.next_value() {
                Ok(Some(v)) => out.push(v),
                Ok(None) => break,
                Err(e) => return (out, Some(e)),
            }
        }
    }
    match d.finish() {
        Ok(Some(v)) => out.push(v),
        Ok(None) => {}
        Err(e) => return (out, Some(e)),
    }
    (out, None)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_splits_decode_identically(
        values in prop::collection::vec(json_value(), 1..8),
        pretty in prop::collection::vec(any::<bool>(), 1..4),
        gaps in prop::collection::vec(any::<usize>(), 1..4),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let bytes = stream(&values, &pretty, &gaps);
        let (got, err) = decode_split(&bytes, &cuts, 1 << 20);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, values);
    }

    #[test]
    fn byte_at_a_time_equals_whole(values in prop::collection::vec(json_value(), 1..4)) {
        let bytes = stream(&values, &[false], &[0]);
        let all_cuts: Vec<usize> = (0..bytes.len()).collect();
        prop_assert_eq!(decode_split(&bytes, &all_cuts, 1 << 20), decode_split(&bytes, &[], 1 << 20));
    }

    #[test]
    fn random_bytes_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        max in 1usize..600,
    ) {
        let (vals, err) = decode_split(&bytes, &cuts, max);
        // Whatever happens, splitting does not change the outcome.
        let (vals2, err2) = decode_split(&bytes, &[], max);
        prop_assert_eq!(vals, vals2);
        prop_assert_eq!(err.is_some(), err2.is_some());
    }

    #[test]
    fn corrupted_streams_never_panic(
        values in prop::collection::vec(json_value(), 1..4),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        cuts in prop::collection::vec(any::<usize>(), 0..10),
    ) {
        let mut bytes = stream(&values, &[true], &[1]);
        for (pos, b) in flips {
            let n = bytes.len();
            bytes[pos % n] = b;
        }
        let _ = decode_split(&bytes, &cuts, 1 << 16);
    }

    #[test]
    fn size_limit_is_enforced(values in prop::collection::vec(json_value(), 1..5), max in 1usize..200) {
        let bytes = stream(&values, &[false], &[1]);
        let (got, err) = decode_split(&bytes, &[7, 31, 90], max);
        let sizes: Vec<usize> = values.iter().map(|v| serde_json::to_vec(v).unwrap().len()).collect();
        match sizes.iter().position(|s| *s > max) {
            None => {
                prop_assert_eq!(err, None);
                prop_assert_eq!(got, values);
            }
            Some(first_big) => {
                prop_assert_eq!(err, Some(DecodeError::TooLarge { limit: max }));
                prop_assert_eq!(&got[..], &values[..first_big]);
            }
        }
    }
}
