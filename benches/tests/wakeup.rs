//! `katablk-bench-wakeup` measures a round trip and writes its JSON report; a CPU it may not run
//! on is a clear error.

// Test code: panicking on unexpected errors is the point.
#![allow(clippy::unwrap_used)]

use std::process::Command;

const WAKEUP: &str = env!("CARGO_BIN_EXE_katablk-bench-wakeup");

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus
}

#[test]
fn measures_round_trips_and_writes_json() {
    let cpus = allowed_cpus();
    let server = cpus[0];
    // On one CPU the two threads share it (the spinning server yields to the waiting driver
    // only at its time-slice end); the numbers mean little there but the tool still works.
    let client = *cpus.get(1).unwrap_or(&server);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("wakeup.json");
    let out = Command::new(WAKEUP)
        .args(["--secs", "0.3", "--ramp", "0.05", "--wait", "poll"])
        .args(["--server-cpu", &server.to_string()])
        .args(["--client-cpu", &client.to_string()])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("round trip p50"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(report["round_trips"].as_u64().unwrap() > 0, "{report}");
    let rtt = &report["round_trip"];
    assert!(rtt["p50_ns"].as_u64().unwrap() > 0, "{report}");
    assert!(
        rtt["p50_ns"].as_u64().unwrap() <= rtt["p99_ns"].as_u64().unwrap(),
        "{report}"
    );
    assert_eq!(report["wait"], "poll");
}

#[test]
fn a_cpu_out_of_range_is_an_error() {
    let out = Command::new(WAKEUP)
        .args(["--secs", "0.1", "--server-cpu", "100000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CPU 100000"), "{stderr}");
}
