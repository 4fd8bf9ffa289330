//! The lease guarantee: once a client has been told a lease is gone (a
//! revoke answered, a TimeToLive answering TTL -1 or a keep-alive
//! answering TTL 0, etcd's words for a lease that does not exist), no read
//! that starts afterwards returns a value that was attached to it. (A
//! TimeToLive of 0 is a lease whose time is up but whose expiry has not
//! been committed yet: its keys may still be read.)

use std::collections::HashMap;

use crate::nemesis::history::{Op, Outcome, Record};

/// The lease checker's findings.
#[derive(Debug, Default)]
pub struct LeaseReport {
    /// Every violation found, in words.
    pub violations: Vec<String>,
    /// Leases granted.
    pub granted: u64,
    /// Leases a client was told were gone.
    pub ended: u64,
    /// Reads of lease keys that started after a client was told their
    /// lease was gone (each must find no value of that lease).
    pub reads_after_end: u64,
}

/// Checks the lease keys' reads of `records`.
pub fn check(records: &[Record]) -> LeaseReport {
    let mut report = LeaseReport::default();
    // The lease each key was put with (whatever the put's outcome: one
    // that timed out may still have been applied). Every lease key is put
    // once, with one lease.
    let mut lease_of: HashMap<&str, i64> = HashMap::new();
    // When a client was first told each lease is gone.
    let mut ended_at: HashMap<i64, u64> = HashMap::new();
    for record in records {
        let Record::Op(op) = record else { continue };
        let gone = match (&op.op, op.outcome) {
            (Op::LeaseGrant { .. }, Outcome::Ok) => {
                report.granted += 1;
                None
            }
            (
                Op::Put {
                    key,
                    lease: Some(lease),
                    ..
                },
                _,
            ) => {
                lease_of.insert(key.as_str(), *lease);
                None
            }
            // Revoked; or already gone (NotFound) when it failed with an answer.
            (Op::LeaseRevoke { lease }, Outcome::Ok | Outcome::Fail) => Some(*lease),
            (Op::LeaseTimeToLive { lease }, Outcome::Ok)
                if op.ttl_secs.is_some_and(|ttl| ttl < 0) =>
            {
                Some(*lease)
            }
            (Op::LeaseKeepAlive { lease }, Outcome::Ok) if op.ttl_secs == Some(0) => Some(*lease),
            _ => None,
        };
        if let (Some(lease), Some(completed)) = (gone, op.completed_us) {
            let at = ended_at.entry(lease).or_insert(completed);
            *at = (*at).min(completed);
        }
    }
    report.ended = ended_at.len() as u64;
    for record in records {
        let Record::Op(op) = record else { continue };
        let (Op::Get { key, .. }, Outcome::Ok) = (&op.op, op.outcome) else {
            continue;
        };
        let Some(lease) = lease_of.get(key.as_str()) else {
            continue;
        };
        let Some(ended) = ended_at.get(lease) else {
            continue;
        };
        if op.invoked_us <= *ended {
            continue;
        }
        report.reads_after_end += 1;
        if let (Some(true), Some(value)) = (op.found, &op.value) {
            report.violations.push(format!(
                "process {} read {key}={value} through member {} at {} us, after a client was told at {ended} us that its lease {lease:x} was gone",
                op.process, op.member, op.invoked_us
            ));
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis::history::OpRecord;

    fn op(op: Op, outcome: Outcome, invoked_us: u64, completed_us: Option<u64>) -> OpRecord {
        OpRecord {
            process: 7,
            member: 1,
            invoked_us,
            completed_us,
            op,
            outcome,
            revision: None,
            found: None,
            value: None,
            value_lease: None,
            lease: None,
            ttl_secs: None,
            error: None,
        }
    }

    fn history(read_at_us: u64) -> Vec<Record> {
        let put = op(
            Op::Put {
                key: "l/1".into(),
                value: "1".into(),
                lease: Some(5),
            },
            Outcome::Unknown,
            0,
            None,
        );
        let mut ttl = op(
            Op::LeaseTimeToLive { lease: 5 },
            Outcome::Ok,
            100,
            Some(110),
        );
        ttl.ttl_secs = Some(-1);
        let mut read = op(
            Op::Get {
                key: "l/1".into(),
                serializable: false,
            },
            Outcome::Ok,
            read_at_us,
            Some(read_at_us + 5),
        );
        read.found = Some(true);
        read.value = Some("1".into());
        vec![Record::Op(put), Record::Op(ttl), Record::Op(read)]
    }

    #[test]
    fn a_read_of_a_lease_key_after_its_end_was_acknowledged_is_a_violation() {
        let report = check(&history(120));
        assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
        assert_eq!(report.reads_after_end, 1);
    }

    #[test]
    fn a_time_to_live_of_zero_is_not_an_end() {
        let mut records = history(120);
        if let Record::Op(op) = &mut records[1] {
            op.ttl_secs = Some(0);
        }
        let report = check(&records);
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(report.ended, 0);
    }

    #[test]
    fn a_read_that_started_before_the_acknowledgment_may_see_the_key() {
        let report = check(&history(105));
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(report.ended, 1);
    }
}
