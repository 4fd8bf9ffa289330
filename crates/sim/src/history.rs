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
