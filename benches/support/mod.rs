//! Reproducible NDJSON event data for the benches: the row shape of the decoder bench.

#![allow(dead_code)]

use sluice::types::{Column, ColumnType, encode_base64};

pub mod floor;
pub mod harness;

/// A small, fast, seeded generator (xorshift64*), so every run sees the same bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

/// The events table the generated rows fit.
pub fn event_columns() -> Vec<Column> {
    vec![
        Column::new("time", ColumnType::Timestamp),
        Column::new("service", ColumnType::String),
        Column::new("name", ColumnType::String),
        Column::new("message", ColumnType::String),
        Column::new("status", ColumnType::Int),
        Column::new("latency", ColumnType::Float),
        Column::new("ok", ColumnType::Boolean),
        Column::new("trace", ColumnType::Binary),
        Column::new("elapsed", ColumnType::Interval),
        Column::new("var", ColumnType::Object),
    ]
}

const SERVICES: &[&str] = &[
    "checkout",
    "search",
    "auth",
    "billing",
    "inventory",
    "gateway",
];
const NAMES: &[&str] = &[
    "payment_failed",
    "request",
    "login",
    "cache_miss",
    "timeout",
    "retry",
];
const WORDS: &[&str] = &[
    "credit", "card", "gateway", "timed", "out", "user", "session", "expired", "upstream",
    "returned", "error", "slow", "query", "cart", "updated",
];
const REGIONS: &[&str] = &["apac", "emea", "amer"];

/// Appends one event row (about 230 bytes) to `out`.
pub fn push_event(rng: &mut Rng, row: u64, out: &mut String) {
    use std::fmt::Write as _;
    let base = 1_792_746_000u64; // 2026-10-23T09:00:00Z
    let secs = base + row / 50;
    let (h, m, s) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
    let days = secs / 86_400 - 20_749; // days after 2026-10-23
    let mut message = String::new();
    for i in 0..(2 + rng.below(4)) {
        if i > 0 {
            message.push(' ');
        }
        message.push_str(rng.pick(WORDS));
    }
    let trace: Vec<u8> = (0..9).map(|_| rng.next() as u8).collect();
    let _ = writeln!(
        out,
        "{{\"time\":\"2026-10-{:02}T{h:02}:{m:02}:{s:02}.{:06}Z\",\"service\":\"{}\",\"name\":\"{}\",\
         \"message\":\"{message}\",\"status\":{},\"latency\":{}.{:03},\"ok\":{},\"trace\":\"{}\",\
         \"elapsed\":\"PT{}.{:03}S\",\"var\":{{\"region\":\"{}\",\"attempt\":{},\"gateway\":\"credit_card\"}}}}",
        23 + days,
        rng.below(1_000_000),
        rng.pick(SERVICES),
        rng.pick(NAMES),
        [200, 200, 200, 404, 500][rng.below(5) as usize],
        rng.below(2000),
        rng.below(1000),
        rng.below(10) != 0,
        encode_base64(&trace),
        rng.below(30),
        rng.below(1000),
        rng.pick(REGIONS),
        rng.below(5),
    );
}

/// `rows` event rows as NDJSON, from `seed`.
pub fn events_ndjson(rows: u64, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut out = String::with_capacity(rows as usize * 240);
    for row in 0..rows {
        push_event(&mut rng, row, &mut out);
    }
    out
}
