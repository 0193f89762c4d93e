//! Aggregation of raw results.
