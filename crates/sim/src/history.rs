//! Client histories: what each client invoked and what it was told, with
//! times. The simulator records one; the linearizability checker reads one
//! (and Jepsen's register histories are parsed into the same shape).

/// A register operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Read the register.
    Read,
    /// Set the register to a value.
    Write(u64),
    /// Set the register to `to` if it holds `from`.
    Cas {
        /// The expected value.
        from: u64,
        /// The new value.
        to: u64,
    },
}

/// What the client was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The operation took effect. For a read, the value read (`None`: the
    /// register was never written).
    Ok {
        /// The value a read returned; `None` for writes and CAS.
        read: Option<u64>,
    },
    /// The operation definitely had no effect (a CAS whose compare failed,
    /// or a request refused before it could take effect).
    Fail,
    /// The client does not know: the operation may take effect at any point
    /// after its invocation, or never.
    Unknown,
}

/// One operation of a history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operation {
    /// The client (process) that ran it. A client runs one operation at a time.
    pub client: u64,
    /// The register (key) it acted on.
    pub key: u64,
    /// What it did.
    pub kind: OpKind,
    /// When it was invoked.
    pub invoked_at: u64,
    /// When it completed; `None` for an unknown outcome (it never completes).
    pub completed_at: Option<u64>,
    /// What the client was told.
    pub outcome: Outcome,
}

/// A whole history: operations on registers that start empty (`None`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct History {
    /// The operations, in any order.
    pub operations: Vec<Operation>,
}

/// The first line of a history in ferry's own text format.
pub const TEXT_HEADER: &str = "# ferry history v1";

/// Why a text history could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct TextError {
    /// The line (from 1).
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

impl History {
    /// The history in ferry's text format: [`TEXT_HEADER`], then one line per
    /// operation, `CLIENT KEY INVOKED COMPLETED OP OUTCOME`, with COMPLETED a
    /// time or `-`, OP one of `read`, `write V`, `cas FROM TO`, and OUTCOME
    /// one of `ok` (a write or CAS), `ok V` or `ok nil` (a read), `fail`,
    /// `unknown`. Times are in microseconds.
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = format!("{TEXT_HEADER}: client key invoked completed op outcome\n");
        for o in &self.operations {
            let completed = o
                .completed_at
                .map_or_else(|| "-".to_string(), |at| at.to_string());
            let op = match o.kind {
                OpKind::Read => "read".to_string(),
                OpKind::Write(value) => format!("write {value}"),
                OpKind::Cas { from, to } => format!("cas {from} {to}"),
            };
            let outcome = match (o.kind, o.outcome) {
                (OpKind::Read, Outcome::Ok { read: Some(value) }) => format!("ok {value}"),
                (OpKind::Read, Outcome::Ok { read: None }) => "ok nil".to_string(),
                (OpKind::Write(_) | OpKind::Cas { .. }, Outcome::Ok { .. }) => "ok".to_string(),
                (_, Outcome::Fail) => "fail".to_string(),
                (_, Outcome::Unknown) => "unknown".to_string(),
            };
            let _ = writeln!(
                out,
                "{} {} {} {completed} {op} {outcome}",
                o.client, o.key, o.invoked_at
            );
        }
        out
    }

    /// Reads a history written by [`History::to_text`]. Blank lines and
    /// lines starting with `#` are skipped.
    pub fn from_text(text: &str) -> Result<History, TextError> {
        let mut operations = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line_no = n + 1;
            let fail = |reason: String| TextError {
                line: line_no,
                reason,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let number = |i: usize, what: &str| -> Result<u64, TextError> {
                let field = fields
                    .get(i)
                    .ok_or_else(|| fail(format!("{what} is missing")))?;
                field
                    .parse::<u64>()
                    .map_err(|_| fail(format!("{what} `{field}` is not a number")))
            };
            let client = number(0, "the client")?;
            let key = number(1, "the key")?;
            let invoked_at = number(2, "the invocation time")?;
            let completed_at = match fields.get(3) {
                Some(&"-") => None,
                Some(_) => Some(number(3, "the completion time")?),
                None => return Err(fail("the completion time is missing".into())),
            };
            if completed_at.is_some_and(|at| at < invoked_at) {
                return Err(fail("it completes before it was invoked".into()));
            }
            let (kind, rest) = match fields.get(4) {
                Some(&"read") => (OpKind::Read, 5),
                Some(&"write") => (OpKind::Write(number(5, "the value written")?), 6),
                Some(&"cas") => (
                    OpKind::Cas {
                        from: number(5, "the value compared")?,
                        to: number(6, "the value set")?,
                    },
                    7,
                ),
                Some(other) => return Err(fail(format!("unknown operation `{other}`"))),
                None => return Err(fail("the operation is missing".into())),
            };
            let outcome = match (kind, &fields[rest.min(fields.len())..]) {
                (OpKind::Read, ["ok", "nil"]) => Outcome::Ok { read: None },
                (OpKind::Read, ["ok", _]) => Outcome::Ok {
                    read: Some(number(rest + 1, "the value read")?),
                },
                (OpKind::Write(_) | OpKind::Cas { .. }, ["ok"]) => Outcome::Ok { read: None },
                (_, ["fail"]) => Outcome::Fail,
                (_, ["unknown"]) => Outcome::Unknown,
                (_, other) => {
                    return Err(fail(format!(
                        "`{}` is not an outcome of this operation",
                        other.join(" ")
                    )))
                }
            };
            operations.push(Operation {
                client,
                key,
                kind,
                invoked_at,
                completed_at,
                outcome,
            });
        }
        Ok(History { operations })
    }
}
