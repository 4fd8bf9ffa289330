//! Loopback ports for test clusters, shared by the runtime's and the
//! `ferry` binary's tests (the latter include this file by path).
//!
//! A port found by binding port 0 comes from the system's ephemeral range,
//! the range it also takes the local end of every outgoing connection from.
//! Released and bound again later by a member that starts late (or
//! restarts), it may by then be the local end of some connection of another
//! test running beside it, and the member's bind fails with `AddrInUse`:
//! that happened once in CI. Below the ephemeral range the system hands out
//! a port only to whoever names it, so a port free here stays free unless
//! another process picks that very number.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port tests pick from.
const PORT_MIN: u32 = 10_000;

/// Where the system's ephemeral range starts (Linux's default when
/// `/proc` does not say).
fn ephemeral_port_min() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .filter(|low| *low > PORT_MIN + 1_000)
        .unwrap_or(32_768)
}

/// A loopback port below the ephemeral range, free now and never handed out
/// before in this process. Processes start at different points of the
/// range (by process id), so test binaries side by side rarely meet.
pub fn free_port() -> u16 {
    static HANDED_OUT: AtomicU32 = AtomicU32::new(0);
    let span = ephemeral_port_min() - PORT_MIN;
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let handed_out = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = PORT_MIN + (start + handed_out) % span;
        let port = u16::try_from(port).expect("ports below the ephemeral range fit in u16");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {}", PORT_MIN + span);
}

/// Ports handed out are below the ephemeral range, free, and never the
/// same twice.
#[test]
fn ports_come_from_below_the_ephemeral_range_and_differ() {
    let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
    for port in &ports {
        assert!(u32::from(*port) >= PORT_MIN && u32::from(*port) < ephemeral_port_min());
    }
    let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
    assert_eq!(distinct.len(), ports.len());
}
