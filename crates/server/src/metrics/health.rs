//! `/health`, `/livez` and `/readyz`, answered as etcd answers them.
//!
//! - `/health`: `{"health":"true","reason":""}` with 200 when the member
//!   has no alarm raised (`?exclude=NOSPACE` ignores one), knows a leader
//!   (not checked with `?serializable=true`) and can serve a read
//!   (linearizable, or local with `serializable=true`); otherwise
//!   `{"health":"false","reason":"..."}` with 503, the reason as etcd words
//!   it (`RAFT NO LEADER`, `ALARM NOSPACE`, `RANGE ERROR:...`).
//! - `/livez` (the process serves: `serializable_read`) and `/readyz` (it
//!   serves the cluster's data: `data_corruption`, `serializable_read`,
//!   `linearizable_read`): `ok` with 200, or 503 with a line per check
//!   (`[+]name ok`, `[-]name failed: reason`). `?exclude=NAME` skips a
//!   check, `?verbose` lists them on success too, and `/livez/NAME`,
//!   `/readyz/NAME` run one.
//!
//! ferry's member refuses reads, even local ones, once it was removed from
//! the cluster or halted on a detected fault (see the README), so both
//! fail the read checks; a halted member fails `data_corruption` too.

use std::collections::BTreeSet;
use std::future::Future;

use crate::backend::NodeStatus;
use crate::error::ApiError;
use crate::pb::etcdserverpb::AlarmType;

/// What the checks read from the member.
pub trait Probe: Send + Sync {
    /// The member's status (leader, removed, halted).
    fn status(&self) -> NodeStatus;
    /// The alarms raised on the cluster.
    fn alarms(&self) -> Vec<AlarmType>;
    /// Waits until the member could serve a linearizable read (ReadIndex),
    /// within the request timeout.
    fn linearizable_read(&self) -> impl Future<Output = Result<(), ApiError>> + Send;
}

/// The query parameters the endpoints read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthQuery {
    /// `exclude=NAME`, any number: alarms (`/health`) or checks not to run.
    pub excluded: BTreeSet<String>,
    /// `serializable=true`: the member's own health, not the cluster's.
    pub serializable: bool,
    /// `verbose` (any value): list every check on success too.
    pub verbose: bool,
}

impl HealthQuery {
    /// Reads a request's query string (without the `?`).
    pub fn parse(query: Option<&str>) -> HealthQuery {
        let mut parsed = HealthQuery::default();
        for pair in query.unwrap_or("").split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let (key, value) = (unescape(key), unescape(value));
            match key.as_str() {
                "exclude" if !value.is_empty() => {
                    parsed.excluded.insert(value);
                }
                "serializable" => parsed.serializable = value == "true",
                "verbose" => parsed.verbose = true,
                _ => {}
            }
        }
        parsed
    }
}

/// Undoes a query's `+` and `%XX` escapes (a bad escape stays as it is).
fn unescape(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match hex {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The answer of `/health`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Whether the member is healthy.
    pub healthy: bool,
    /// Why not, in etcd's words; empty when healthy.
    pub reason: String,
}

impl Health {
    fn ok() -> Health {
        Health {
            healthy: true,
            reason: String::new(),
        }
    }

    fn failed(reason: impl Into<String>) -> Health {
        Health {
            healthy: false,
            reason: reason.into(),
        }
    }

    /// The JSON body: `{"health":"true","reason":""}`.
    pub fn json(&self) -> String {
        format!(
            "{{\"health\":\"{}\",\"reason\":\"{}\"}}",
            if self.healthy { "true" } else { "false" },
            json_escape(&self.reason)
        )
    }
}

/// `text` as the inside of a JSON string.
fn json_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// The first alarm not excluded, in etcd's words.
pub fn check_alarms(alarms: &[AlarmType], excluded: &BTreeSet<String>) -> Result<(), String> {
    for alarm in alarms {
        if *alarm == AlarmType::None || excluded.contains(alarm.as_str_name()) {
            continue;
        }
        return Err(match alarm {
            AlarmType::Nospace => "ALARM NOSPACE",
            AlarmType::Corrupt => "ALARM CORRUPT",
            AlarmType::None => "ALARM UNKNOWN",
        }
        .to_string());
    }
    Ok(())
}

/// Whether the member knows a leader (not asked with `serializable`).
pub fn check_leader(status: &NodeStatus, serializable: bool) -> Result<(), String> {
    if !serializable && status.leader_id == 0 {
        return Err("RAFT NO LEADER".to_string());
    }
    Ok(())
}

/// Why the member would refuse even a local read, if it would.
fn read_refusal(status: &NodeStatus) -> Option<ApiError> {
    if status.removed {
        return Some(ApiError::Removed);
    }
    status.halted.clone().map(ApiError::Halted)
}

/// Whether the member serves a read: a local one, or a linearizable one.
async fn read<P: Probe>(probe: &P, serializable: bool) -> Result<(), ApiError> {
    if let Some(refusal) = read_refusal(&probe.status()) {
        return Err(refusal);
    }
    if serializable {
        Ok(())
    } else {
        probe.linearizable_read().await
    }
}

/// `/health`: alarms, then the leader, then a read, the first failure
/// answering.
pub async fn health<P: Probe>(probe: &P, query: &HealthQuery) -> Health {
    if let Err(reason) = check_alarms(&probe.alarms(), &query.excluded) {
        return Health::failed(reason);
    }
    if let Err(reason) = check_leader(&probe.status(), query.serializable) {
        return Health::failed(reason);
    }
    match read(probe, query.serializable).await {
        Ok(()) => Health::ok(),
        Err(error) => Health::failed(format!("RANGE ERROR:{error}")),
    }
}

/// Which set of checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckKind {
    /// `/livez`: the process serves.
    Livez,
    /// `/readyz`: it serves the cluster's data.
    Readyz,
}

impl CheckKind {
    /// The checks of this kind, in the order they run.
    pub fn checks(self) -> &'static [&'static str] {
        match self {
            CheckKind::Livez => &["serializable_read"],
            CheckKind::Readyz => &["data_corruption", "serializable_read", "linearizable_read"],
        }
    }
}

/// What a set of checks found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// Whether every check passed.
    pub ok: bool,
    /// A line per check run: `[+]name ok` or `[-]name failed: reason`.
    pub lines: String,
}

impl CheckReport {
    /// The body to answer with (200 when `ok`, 503 otherwise).
    pub fn body(&self, verbose: bool) -> String {
        match (self.ok, verbose) {
            (true, false) => "ok\n".to_string(),
            (true, true) => format!("{}ok\n", self.lines),
            (false, _) => format!("{}\n", self.lines),
        }
    }
}

async fn run_check<P: Probe>(probe: &P, name: &str) -> Result<(), String> {
    match name {
        "data_corruption" => {
            if probe.alarms().contains(&AlarmType::Corrupt) {
                return Err("alarm activated: CORRUPT".to_string());
            }
            match probe.status().halted {
                Some(fault) => Err(format!("halted on a detected fault: {fault}")),
                None => Ok(()),
            }
        }
        "serializable_read" => read(probe, true).await.map_err(|e| e.to_string()),
        "linearizable_read" => read(probe, false).await.map_err(|e| e.to_string()),
        other => Err(format!("no check named {other}")),
    }
}

/// Runs the checks of `kind` but those excluded, or only `only` (a check
/// of that kind, for `/livez/NAME`); `None` if `only` names no check of
/// the kind.
pub async fn run_checks<P: Probe>(
    probe: &P,
    kind: CheckKind,
    only: Option<&str>,
    query: &HealthQuery,
) -> Option<CheckReport> {
    let names: Vec<&str> = match only {
        Some(name) => vec![*kind.checks().iter().find(|check| **check == name)?],
        None => kind
            .checks()
            .iter()
            .copied()
            .filter(|name| !query.excluded.contains(*name))
            .collect(),
    };
    let mut report = CheckReport {
        ok: true,
        lines: String::new(),
    };
    for name in names {
        match run_check(probe, name).await {
            Ok(()) => report.lines.push_str(&format!("[+]{name} ok\n")),
            Err(reason) => {
                report.ok = false;
                report
                    .lines
                    .push_str(&format!("[-]{name} failed: {reason}\n"));
            }
        }
    }
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member as the checks see it; `read` is what a linearizable read
    /// answers.
    struct Fake {
        status: NodeStatus,
        alarms: Vec<AlarmType>,
        read: Result<(), ApiError>,
    }

    impl Fake {
        /// A member that knows leader 1 and serves reads.
        fn healthy() -> Fake {
            Fake {
                status: NodeStatus {
                    member_id: 2,
                    leader_id: 1,
                    ..NodeStatus::default()
                },
                alarms: Vec::new(),
                read: Ok(()),
            }
        }
    }

    impl Probe for Fake {
        fn status(&self) -> NodeStatus {
            self.status.clone()
        }
        fn alarms(&self) -> Vec<AlarmType> {
            self.alarms.clone()
        }
        async fn linearizable_read(&self) -> Result<(), ApiError> {
            self.read.clone()
        }
    }

    fn query(text: &str) -> HealthQuery {
        HealthQuery::parse(Some(text))
    }

    #[tokio::test]
    async fn a_member_with_a_leader_that_serves_reads_is_healthy() {
        let health = health(&Fake::healthy(), &HealthQuery::default()).await;
        assert!(health.healthy);
        assert_eq!(health.json(), r#"{"health":"true","reason":""}"#);
    }

    #[tokio::test]
    async fn no_leader_is_unhealthy_unless_serializable_is_asked() {
        let mut member = Fake::healthy();
        member.status.leader_id = 0;
        member.read = Err(ApiError::NoLeader);
        let health = health(&member, &HealthQuery::default()).await;
        assert_eq!(
            health.json(),
            r#"{"health":"false","reason":"RAFT NO LEADER"}"#
        );
        // The member's own health: it still serves local reads.
        assert!(
            super::health(&member, &query("serializable=true"))
                .await
                .healthy
        );
    }

    #[tokio::test]
    async fn removed_and_halted_members_fail_the_read_even_a_local_one() {
        let mut removed = Fake::healthy();
        removed.status.removed = true;
        for q in ["", "serializable=true"] {
            let health = health(&removed, &query(q)).await;
            assert!(!health.healthy);
            assert_eq!(
                health.reason,
                "RANGE ERROR:the member has been permanently removed from the cluster"
            );
        }
        let mut halted = Fake::healthy();
        halted.status.halted = Some("log conflict at \"7\"".into());
        let health = health(&halted, &HealthQuery::default()).await;
        assert!(!health.healthy);
        assert!(
            health.reason.starts_with("RANGE ERROR:"),
            "{}",
            health.reason
        );
        assert!(
            health.json().contains(r#"at \"7\""#),
            "escaped: {}",
            health.json()
        );
    }

    #[tokio::test]
    async fn a_read_that_fails_is_a_range_error() {
        let mut member = Fake::healthy();
        member.read = Err(ApiError::Timeout);
        let health = health(&member, &HealthQuery::default()).await;
        assert_eq!(health.reason, "RANGE ERROR:etcdserver: request timed out");
        // Not asked with serializable=true.
        assert!(
            super::health(&member, &query("serializable=true"))
                .await
                .healthy
        );
    }

    #[tokio::test]
    async fn alarms_come_first_and_can_be_excluded() {
        let mut member = Fake::healthy();
        member.alarms = vec![AlarmType::Nospace];
        member.status.leader_id = 0;
        let health = health(&member, &HealthQuery::default()).await;
        assert_eq!(health.reason, "ALARM NOSPACE");
        let health = super::health(&member, &query("exclude=NOSPACE")).await;
        assert_eq!(health.reason, "RAFT NO LEADER");
        member.alarms = vec![AlarmType::Nospace, AlarmType::Corrupt];
        let health = super::health(&member, &query("exclude=NOSPACE")).await;
        assert_eq!(health.reason, "ALARM CORRUPT");
    }

    #[tokio::test]
    async fn livez_and_readyz_list_their_checks() {
        let member = Fake::healthy();
        let livez = run_checks(&member, CheckKind::Livez, None, &HealthQuery::default())
            .await
            .unwrap();
        assert!(livez.ok);
        assert_eq!(livez.body(false), "ok\n");
        assert_eq!(livez.body(true), "[+]serializable_read ok\nok\n");

        let mut member = Fake::healthy();
        member.read = Err(ApiError::NoLeader);
        let readyz = run_checks(&member, CheckKind::Readyz, None, &HealthQuery::default())
            .await
            .unwrap();
        assert!(!readyz.ok);
        assert_eq!(
            readyz.lines,
            "[+]data_corruption ok\n[+]serializable_read ok\n[-]linearizable_read failed: etcdserver: no leader\n"
        );
        // Alive all the same.
        assert!(
            run_checks(&member, CheckKind::Livez, None, &HealthQuery::default())
                .await
                .unwrap()
                .ok
        );
        let excluded = run_checks(
            &member,
            CheckKind::Readyz,
            None,
            &query("exclude=linearizable_read"),
        )
        .await
        .unwrap();
        assert!(excluded.ok);
        let one = run_checks(
            &member,
            CheckKind::Readyz,
            Some("linearizable_read"),
            &HealthQuery::default(),
        )
        .await
        .unwrap();
        assert_eq!(
            one.lines,
            "[-]linearizable_read failed: etcdserver: no leader\n"
        );
        assert!(run_checks(
            &member,
            CheckKind::Livez,
            Some("linearizable_read"),
            &HealthQuery::default()
        )
        .await
        .is_none());
    }

    #[tokio::test]
    async fn a_halted_member_is_alive_but_not_ready() {
        let mut member = Fake::healthy();
        member.status.halted = Some("conflict".into());
        let readyz = run_checks(&member, CheckKind::Readyz, None, &HealthQuery::default())
            .await
            .unwrap();
        assert!(!readyz.ok);
        assert!(readyz
            .lines
            .starts_with("[-]data_corruption failed: halted on a detected fault: conflict\n"));
        let livez = run_checks(&member, CheckKind::Livez, None, &HealthQuery::default())
            .await
            .unwrap();
        assert!(!livez.ok, "a halted member serves no reads at all");
    }

    #[test]
    fn queries_are_read_with_their_escapes() {
        let q = query("exclude=NOSPACE&exclude=&serializable=true&verbose&exclude=a%20b+c&x=%zz");
        assert_eq!(
            q.excluded,
            ["NOSPACE", "a b c"].iter().map(|s| s.to_string()).collect()
        );
        assert!(q.serializable && q.verbose);
        assert!(!query("serializable=yes").serializable);
        assert_eq!(HealthQuery::parse(None), HealthQuery::default());
        // Nothing a client sends makes parsing fail.
        let _ = query("%");
        let _ = query("%f");
        let _ = query("=&&==%ff%fe");
    }
}
