//! Every check of a nemesis history: the registers' linearizability (the
//! simulator's checker, `ferry_sim::lincheck`), the watch guarantees
//! ([`watch`]) and the lease guarantee ([`leases`]).

pub mod leases;
pub mod watch;

use std::collections::BTreeMap;

use ferry_sim::history::{History, OpKind, Operation, Outcome as LinOutcome};
use ferry_sim::lincheck::{self, CheckOptions, Verdict};

use super::history::{Op, OpRecord, Outcome, Record, REGISTER_PREFIX};

/// The register operations of a history, as the linearizability checker
/// reads them: key `r/<n>` is register `n`, values are the decimal numbers
/// written. A value read that is not a number no client wrote is an error.
pub fn register_history(records: &[Record]) -> Result<History, String> {
    let mut operations = Vec::new();
    for record in records {
        let Record::Op(op) = record else { continue };
        if let Some(operation) = register_operation(op)? {
            operations.push(operation);
        }
    }
    Ok(History { operations })
}

fn register_number(key: &str) -> Option<u64> {
    key.strip_prefix(REGISTER_PREFIX)?.parse().ok()
}

fn value_number(value: &str, what: &str, op: &OpRecord) -> Result<u64, String> {
    value.parse().map_err(|_| {
        format!(
            "process {} at {} us: {what} {value:?} is not a value the test writes",
            op.process, op.invoked_us
        )
    })
}

fn register_operation(op: &OpRecord) -> Result<Option<Operation>, String> {
    let (key, kind) = match &op.op {
        Op::Get { key, .. } => (key, OpKind::Read),
        Op::Put {
            key, value, lease, ..
        } if lease.is_none() => (
            key,
            OpKind::Write(value_number(value, "the value put", op)?),
        ),
        Op::Cas { key, from, to } => {
            // A compare with nothing known compares against the empty
            // value, which no register ever holds: it can only fail.
            let from = if from.is_empty() {
                u64::MAX
            } else {
                value_number(from, "the value compared", op)?
            };
            (
                key,
                OpKind::Cas {
                    from,
                    to: value_number(to, "the value set", op)?,
                },
            )
        }
        _ => return Ok(None),
    };
    let Some(register) = register_number(key) else {
        return Ok(None);
    };
    let outcome = match (op.outcome, kind) {
        (Outcome::Ok, OpKind::Read) => LinOutcome::Ok {
            read: match (op.found, &op.value) {
                (Some(true), Some(value)) => Some(value_number(value, "the value read", op)?),
                _ => None,
            },
        },
        (Outcome::Ok, _) => LinOutcome::Ok { read: None },
        (Outcome::Fail, _) => LinOutcome::Fail,
        (Outcome::Unknown, _) => LinOutcome::Unknown,
    };
    let completed_at = match outcome {
        LinOutcome::Unknown => None,
        _ => Some(op.completed_us.unwrap_or(op.invoked_us)),
    };
    Ok(Some(Operation {
        client: op.process,
        key: register,
        kind,
        invoked_at: op.invoked_us,
        completed_at,
        outcome,
    }))
}

/// Counts for the summary line.
#[derive(Debug, Default)]
pub struct Counts {
    /// Operations by outcome.
    pub ok: u64,
    /// Certainly without effect.
    pub fail: u64,
    /// Unknown outcome.
    pub unknown: u64,
    /// Operations of each kind (`get`, `put`, `cas`, `lease-grant`, ...).
    pub by_kind: BTreeMap<&'static str, u64>,
    /// Faults applied, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Members that exited by themselves.
    pub crashes: u64,
}

impl Counts {
    /// Counts `records`.
    pub fn of(records: &[Record]) -> Counts {
        let mut counts = Counts::default();
        for record in records {
            match record {
                Record::Op(op) => {
                    match op.outcome {
                        Outcome::Ok => counts.ok += 1,
                        Outcome::Fail => counts.fail += 1,
                        Outcome::Unknown => counts.unknown += 1,
                    }
                    let kind = match op.op {
                        Op::Get { .. } => "get",
                        Op::Put { lease: None, .. } => "put",
                        Op::Put { lease: Some(_), .. } => "lease-put",
                        Op::Cas { .. } => "cas",
                        Op::LeaseGrant { .. } => "lease-grant",
                        Op::LeaseKeepAlive { .. } => "keep-alive",
                        Op::LeaseTimeToLive { .. } => "time-to-live",
                        Op::LeaseRevoke { .. } => "revoke",
                        Op::DisarmNoSpace => "disarm",
                    };
                    *counts.by_kind.entry(kind).or_default() += 1;
                }
                Record::Fault(fault) if fault.fault == "crash" => counts.crashes += 1,
                Record::Fault(fault) if !fault.heal => {
                    *counts.faults.entry(fault.fault.clone()).or_default() += 1
                }
                Record::Header(_) | Record::Watch(_) | Record::Fault(_) => {}
            }
        }
        counts
    }
}

/// The result of every check.
#[derive(Debug)]
pub struct CheckReport {
    /// The registers' verdict, or why the history could not be read as one.
    pub registers: Result<Verdict, String>,
    /// The watch checker's findings.
    pub watch: watch::WatchReport,
    /// The lease checker's findings.
    pub leases: leases::LeaseReport,
    /// Counts for the summary.
    pub counts: Counts,
}

impl CheckReport {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        matches!(self.registers, Ok(Verdict::Linearizable))
            && self.watch.violations.is_empty()
            && self.leases.violations.is_empty()
    }

    /// `linearizable`, `NOT-linearizable` or `undecided` for the registers.
    pub fn registers_word(&self) -> &'static str {
        match &self.registers {
            Ok(Verdict::Linearizable) => "linearizable",
            Ok(Verdict::NotLinearizable(_)) | Err(_) => "NOT-linearizable",
            Ok(Verdict::Undecided { .. } | Verdict::InvalidHistory { .. }) => "undecided",
        }
    }
}

/// Runs every check on `records`.
pub fn check(records: &[Record], options: CheckOptions) -> CheckReport {
    let registers =
        register_history(records).map(|history| lincheck::check_with(&history, options));
    CheckReport {
        registers,
        watch: watch::check(records),
        leases: leases::check(records),
        counts: Counts::of(records),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(process: u64, op: Op, outcome: Outcome, at: (u64, Option<u64>)) -> OpRecord {
        OpRecord {
            process,
            member: 1,
            invoked_us: at.0,
            completed_us: at.1,
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

    fn read(process: u64, at: (u64, u64), value: Option<&str>) -> Record {
        let mut record = op(
            process,
            Op::Get {
                key: "r/3".into(),
                serializable: false,
            },
            Outcome::Ok,
            (at.0, Some(at.1)),
        );
        record.found = Some(value.is_some());
        record.value = value.map(str::to_string);
        Record::Op(record)
    }

    fn write(process: u64, at: (u64, u64), value: &str) -> Record {
        Record::Op(op(
            process,
            Op::Put {
                key: "r/3".into(),
                value: value.into(),
                lease: None,
            },
            Outcome::Ok,
            (at.0, Some(at.1)),
        ))
    }

    #[test]
    fn a_stale_read_is_not_linearizable_and_a_fresh_one_is() {
        let fresh = vec![write(1, (0, 10), "5"), read(2, (20, 30), Some("5"))];
        let report = check(&fresh, CheckOptions::default());
        assert_eq!(report.registers_word(), "linearizable");
        assert!(report.passed());
        let stale = vec![
            write(1, (0, 10), "5"),
            write(1, (20, 30), "6"),
            read(2, (40, 50), Some("5")),
        ];
        let report = check(&stale, CheckOptions::default());
        assert_eq!(report.registers_word(), "NOT-linearizable");
        assert!(!report.passed());
    }

    #[test]
    fn register_operations_map_to_the_checker_s_and_others_are_left_out() {
        let records = vec![
            Record::Op(op(
                1,
                Op::Cas {
                    key: "r/3".into(),
                    from: String::new(),
                    to: "7".into(),
                },
                Outcome::Fail,
                (0, Some(5)),
            )),
            Record::Op(op(
                1,
                Op::Put {
                    key: "l/9".into(),
                    value: "9".into(),
                    lease: Some(1),
                },
                Outcome::Unknown,
                (6, None),
            )),
            Record::Op(op(
                2,
                Op::Put {
                    key: "r/3".into(),
                    value: "8".into(),
                    lease: None,
                },
                Outcome::Unknown,
                (7, None),
            )),
        ];
        let history = register_history(&records).unwrap();
        assert_eq!(history.operations.len(), 2);
        assert_eq!(
            history.operations[0].kind,
            OpKind::Cas {
                from: u64::MAX,
                to: 7
            }
        );
        assert_eq!(history.operations[1].completed_at, None);
        let garbage = vec![read(2, (1, 2), Some("not a number"))];
        assert!(register_history(&garbage).is_err());
    }
}
