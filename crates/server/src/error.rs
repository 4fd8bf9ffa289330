//! Errors of the key-value state machine and of the API, with etcd's exact
//! messages: etcd client libraries recognise errors by their text, so these
//! strings are part of the wire contract.

use thiserror::Error;

/// A request the key-value state machine refuses. Deterministic: every
/// replica refuses the same command with the same error, except
/// [`KvError::Storage`], which is this member's own failure.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    /// This member's store could not be read (an I/O error, or data that
    /// failed its checksum). Not a refusal of the request: the member
    /// cannot go on applying the log and stops serving.
    #[error("ferry: this member's store failed: {0}")]
    Storage(String),
    /// A member add picked an id another add took first; retry the add.
    #[error("etcdserver: member ID already exists")]
    MemberIdTaken,
    /// A key-addressed request had an empty key.
    #[error("etcdserver: key is not provided")]
    EmptyKey,
    /// The requested revision was removed by compaction.
    #[error("etcdserver: mvcc: required revision has been compacted")]
    Compacted {
        /// The store's compacted revision, which clients may resume from.
        compacted_revision: i64,
    },
    /// The requested revision has not happened yet.
    #[error("etcdserver: mvcc: required revision is a future revision")]
    FutureRevision,
    /// The lease named in the request does not exist.
    #[error("etcdserver: requested lease not found")]
    LeaseNotFound,
    /// A grant asked for an id that is already in use.
    #[error("etcdserver: lease already exists")]
    LeaseExists,
    /// A grant asked for a TTL above the maximum.
    #[error("etcdserver: too large lease TTL")]
    LeaseTtlTooLarge,
    /// The encoded request is larger than the configured limit.
    #[error("etcdserver: request is too large")]
    RequestTooLarge,
    /// A txn has more operations than allowed, nested txns included (see
    /// [`crate::kv_state::txn_ops`]).
    #[error("etcdserver: too many operations in txn request")]
    TooManyTxnOps,
    /// What a txn would answer (the key-values of its ranges, the previous
    /// values of its puts and deletes) exceeds the limit; nothing was
    /// written. etcd has no such limit; ferry has it so that one txn cannot
    /// make every replica build gigabytes.
    #[error("etcdserver: txn response is too large (limit {bytes_max} bytes); read less per txn, e.g. with a limit or smaller ranges")]
    TxnResponseTooLarge {
        /// The limit the txn was admitted under.
        bytes_max: usize,
    },
    /// A txn writes one key twice, or deletes a key it also puts.
    #[error("etcdserver: duplicate key given in txn request")]
    DuplicateKey,
    /// Txns are nested deeper than ferry allows.
    #[error("etcdserver: txn nested deeper than {depth_max} levels")]
    TxnTooDeep {
        /// The configured nesting limit.
        depth_max: usize,
    },
    /// `ignore_value` or `ignore_lease` was set for a key that does not exist.
    #[error("etcdserver: key not found")]
    KeyNotFound,
    /// `ignore_value` was set together with a value.
    #[error("etcdserver: value is provided")]
    ValueProvided,
    /// `ignore_lease` was set together with a lease.
    #[error("etcdserver: lease is provided")]
    LeaseProvided,
    /// A NOSPACE alarm is raised: writes that grow the store (puts, txns
    /// with a put, lease grants) are refused until it is cleared; reads,
    /// deletes and compaction still run.
    #[error("etcdserver: mvcc: database space exceeded")]
    NoSpace,
    /// The store stands at [`crate::mvcc::REVISION_MAX`], the last
    /// revision it may reach (only a snapshot that was restored there gets
    /// a store this far): writes are refused, reads still run.
    #[error("ferry: the store is at its last revision and takes no more writes")]
    RevisionsExhausted,
    /// An auth call or a permission check failed.
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthError),
    /// A command could not be decoded from the log.
    #[error("ferry: cannot decode state machine command: {0}")]
    Decode(#[from] CodecError),
    /// The command's log index was already applied (a replay after restart).
    #[error("ferry: log index {index} is not after the applied index {applied_index}")]
    AlreadyApplied {
        /// The index of the command.
        index: u64,
        /// The index the state machine had already applied.
        applied_index: u64,
    },
}

/// Malformed bytes given to the command or snapshot codec.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CodecError {
    /// The input is empty.
    #[error("empty input")]
    Empty,
    /// The format byte names a format this build does not know.
    #[error("unknown format version {found} (this build reads version {supported})")]
    UnknownVersion {
        /// The version byte found.
        found: u8,
        /// The version this build understands.
        supported: u8,
    },
    /// The protobuf body does not parse.
    #[error("malformed body: {0}")]
    Malformed(String),
    /// The command has no kind set.
    #[error("command carries no operation")]
    MissingKind,
    /// The snapshot does not start with ferry's snapshot magic.
    #[error("not a ferry key-value snapshot (bad magic)")]
    BadMagic,
    /// The snapshot is shorter than its fixed header and trailer.
    #[error("snapshot truncated: {size_bytes} bytes")]
    Truncated {
        /// The size found.
        size_bytes: usize,
    },
    /// The snapshot's checksum does not match its contents.
    #[error("snapshot checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The checksum in the trailer.
        stored: u32,
        /// The checksum of the bytes read.
        computed: u32,
    },
    /// The snapshot decodes but its contents contradict each other.
    #[error("snapshot is inconsistent: {0}")]
    Inconsistent(String),
    /// The snapshot could not be read from where it is kept.
    #[error("reading the snapshot: {0}")]
    Read(String),
}

/// Why an API call failed, beyond the state machine's own refusals.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ApiError {
    /// The state machine refused the request.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// No leader is known, so the request cannot be ordered.
    #[error("etcdserver: no leader")]
    NoLeader,
    /// The request was not committed in time; it may still be applied.
    #[error("etcdserver: request timed out")]
    Timeout,
    /// The node is shutting down.
    #[error("etcdserver: server stopped")]
    Stopped,
    /// The member id is not part of the cluster.
    #[error("etcdserver: member not found")]
    MemberNotFound,
    /// The peer URL is already used by a member.
    #[error("etcdserver: Peer URLs already exists")]
    PeerUrlExists,
    /// Promote was asked for a member that is already a voter.
    #[error("etcdserver: can only promote a learner member")]
    MemberNotLearner,
    /// Promote was asked for a learner that has not caught up.
    #[error("etcdserver: can only promote a learner member which is in sync with leader")]
    LearnerNotReady,
    /// The membership change would leave the cluster without a quorum.
    #[error("etcdserver: re-configuration failed due to not enough started members")]
    NotEnoughMembers,
    /// A voter add the members this node reaches could not form a quorum
    /// of (etcd's strict reconfiguration check). The text is etcd's; the
    /// fields say what was counted.
    #[error("etcdserver: re-configuration failed due to not enough started members ({started} of the {voters} voters after the add are started and connected, {quorum} are needed; start the missing members first, or add the new one with --learner)")]
    NotEnoughStartedMembers {
        /// Voters after the add.
        voters: usize,
        /// Those started and connected to this node (this node included).
        started: usize,
        /// The quorum of `voters`.
        quorum: usize,
    },
    /// A call that only the leader answers (MoveLeader) reached another
    /// member.
    #[error("etcdserver: not leader")]
    NotLeader,
    /// MoveLeader named a member that cannot lead: unknown, or a learner.
    #[error("etcdserver: bad leader transferee")]
    BadLeaderTransferee,
    /// MoveLeader started, but the named member did not take over within
    /// the request timeout.
    #[error("etcdserver: request timed out, leader transfer took too long")]
    TimeoutLeaderTransfer,
    /// A peer URL given to MemberAdd is not `http(s)://host:port`.
    #[error("etcdserver: given member URLs are invalid")]
    BadMemberUrls,
    /// This member was removed from the cluster and serves no more client
    /// requests; its data is stale.
    #[error("the member has been permanently removed from the cluster")]
    Removed,
    /// This member halted its group on a detected fault (its log
    /// contradicts a committed entry) and serves no more client requests
    /// until it is repaired; the text names the fault.
    #[error("ferry: this member halted on a detected fault and serves no requests: {0}")]
    Halted(String),
    /// The request is malformed in a way the state machine does not check.
    #[error("ferry: invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// ferry does not offer this call.
    #[error("ferry: {0} is not supported")]
    Unimplemented(&'static str),
    /// The node hit an internal failure; the text says which.
    #[error("ferry: internal error: {0}")]
    Internal(String),
}

impl From<crate::auth::AuthError> for ApiError {
    fn from(error: crate::auth::AuthError) -> Self {
        ApiError::Kv(KvError::Auth(error))
    }
}

impl From<CodecError> for ApiError {
    fn from(error: CodecError) -> Self {
        ApiError::Kv(KvError::Decode(error))
    }
}

impl From<ApiError> for tonic::Status {
    fn from(error: ApiError) -> Self {
        use tonic::Code;
        let code = match &error {
            ApiError::Kv(kv) => match kv {
                KvError::EmptyKey
                | KvError::RequestTooLarge
                | KvError::TooManyTxnOps
                | KvError::TxnResponseTooLarge { .. }
                | KvError::DuplicateKey
                | KvError::TxnTooDeep { .. }
                | KvError::KeyNotFound
                | KvError::ValueProvided
                | KvError::LeaseProvided => Code::InvalidArgument,
                KvError::Compacted { .. } | KvError::FutureRevision | KvError::LeaseTtlTooLarge => {
                    Code::OutOfRange
                }
                KvError::LeaseNotFound => Code::NotFound,
                KvError::LeaseExists | KvError::MemberIdTaken => Code::FailedPrecondition,
                KvError::NoSpace | KvError::RevisionsExhausted => Code::ResourceExhausted,
                KvError::Auth(auth) => auth.code(),
                KvError::Decode(_) | KvError::AlreadyApplied { .. } => Code::Internal,
                // Clients move to another member on Unavailable.
                KvError::Storage(_) => Code::Unavailable,
            },
            // Unavailable: etcd clients move to another endpoint on it.
            ApiError::NoLeader
            | ApiError::Timeout
            | ApiError::TimeoutLeaderTransfer
            | ApiError::Stopped
            | ApiError::Removed
            | ApiError::Halted(_) => Code::Unavailable,
            ApiError::MemberNotFound => Code::NotFound,
            ApiError::PeerUrlExists => Code::FailedPrecondition,
            ApiError::NotLeader | ApiError::BadLeaderTransferee => Code::FailedPrecondition,
            ApiError::MemberNotLearner
            | ApiError::LearnerNotReady
            | ApiError::NotEnoughMembers
            | ApiError::NotEnoughStartedMembers { .. } => Code::FailedPrecondition,
            ApiError::InvalidArgument(_) | ApiError::BadMemberUrls => Code::InvalidArgument,
            ApiError::Unimplemented(_) => Code::Unimplemented,
            ApiError::Internal(_) => Code::Internal,
        };
        tonic::Status::new(code, error.to_string())
    }
}

impl From<KvError> for std::io::Error {
    /// A snapshot written to a file or a peer stops on a failed read of
    /// the store.
    fn from(error: KvError) -> Self {
        std::io::Error::other(error.to_string())
    }
}
