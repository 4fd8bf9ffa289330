//! The contract an embedder implements: a replicated state machine.
//!
//! The runtime calls a machine from one thread at a time (the worker that
//! owns its group), so a machine needs no locking of its own unless it
//! shares its state with other threads (as the etcd server does, to read
//! without going through the runtime).

use std::io;

use bytes::Bytes;
use ferry_raft::{Index, Term};

/// One committed command, as the runtime hands it to
/// [`StateMachine::apply`].
#[derive(Debug, Clone, Copy)]
pub struct Command<'a> {
    /// The command's place in the group's log.
    pub index: Index,
    /// The term of the leader that proposed it.
    pub term: Term,
    /// The bytes given to [`crate::GroupHandle::propose`], as the log
    /// holds them: a machine may keep slices of them (`Bytes::slice`)
    /// without a copy, and prost decodes a message's `bytes` fields from
    /// a `Bytes` buffer as slices of it.
    pub data: &'a Bytes,
    /// Whether a caller on this node waits for the response. On every other
    /// member (and when the log is applied again after a restart) the
    /// response is thrown away, so a machine may skip building an expensive
    /// one (read results, say). It must not change what the command does to
    /// the state.
    pub answered: bool,
}

/// This member could not apply a committed command because something of its
/// own failed (a durable machine's disk could not be read or written), not
/// because of the command. A command that cannot be carried out gets an
/// error *response* instead, the same on every member; this error is for
/// what differs between members.
///
/// The runtime then stops the group on this node as a crash would: the
/// command and everything after it stay unapplied here, requests waiting on
/// the group fail with [`crate::GroupError::MachineFailed`] and new ones are
/// refused, the other members go on without it, and the group's view and
/// [`GroupEvent::Halted`] say why. Starting the group again (after the cause
/// is mended) applies the command again, so the machine must leave its
/// state as it was before the command when it returns this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct ApplyError {
    reason: String,
}

impl ApplyError {
    /// An apply failure for `reason` (what failed, naming the file or
    /// device if there is one).
    pub fn new(reason: impl Into<String>) -> ApplyError {
        ApplyError {
            reason: reason.into(),
        }
    }

    /// What failed.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Something that happened to a group on this node, for
/// [`StateMachine::on_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    /// This node's role in the group changed, or it learned of a new
    /// leader.
    RoleChanged {
        /// The new role.
        role: ferry_raft::Role,
        /// The term.
        term: Term,
        /// The leader it knows of.
        leader: Option<ferry_raft::NodeId>,
    },
    /// The group's configuration (its voters and learners) changed.
    ConfigChanged(ferry_raft::Configuration),
    /// This node was removed from the group: it serves no more requests.
    Removed,
    /// This node halted the group on a detected fault (its log contradicts
    /// a committed entry, say) or stopped it because the machine could not
    /// apply a command ([`ApplyError`]): it serves no more requests until it
    /// is repaired or started again. The text names the fault.
    Halted(String),
}

/// How a machine keeps its state, which decides how the runtime compacts
/// the group's log and sends a lagging follower the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The state lives in memory and is lost with the process. The runtime
    /// writes snapshots of it (when [`crate::SnapshotPolicy`] says) and
    /// compacts the log behind them; on start the machine is restored from
    /// the latest snapshot and the log after it is applied again.
    InMemory,
    /// The machine keeps its state on disk itself, and says through
    /// [`StateMachine::durable_index`] what it has made durable. The runtime
    /// compacts the log behind that without ever writing the state out; a
    /// follower that needs the state is sent the machine's view
    /// ([`StateMachine::snapshot`]) streamed as it is written; on start the
    /// runtime applies only what follows [`StateMachine::applied_index`].
    Durable,
}

/// A replicated state machine: the part of a Raft group an embedder writes.
///
/// # What must be deterministic
///
/// [`apply`](Self::apply) must be a function of the machine's state and the
/// command alone: the same commands applied in the same order give the same
/// state and the same responses on every member, on every run. It must not
/// read the clock, random numbers, the environment or anything outside the
/// machine (put such values into the command when proposing it). It must not
/// panic on any command: a command that cannot be carried out gets an error
/// *response*, the same on every member. A committed command is applied on
/// every member and again after every restart from an older snapshot, so a
/// panic there would take every member down, for good. Only a failure of
/// the member itself (its disk) is an [`ApplyError`], which stops the group
/// on that member alone.
///
/// [`query`](Self::query), [`snapshot`](Self::snapshot) and the methods that
/// report indexes only read, and need not be deterministic.
pub trait StateMachine: Send + 'static {
    /// What applying a command answers, given to the proposer.
    type Response: Send + 'static;
    /// A question about the applied state.
    type Query: Send + 'static;
    /// The answer to a query.
    type QueryResponse: Send + 'static;

    /// Applies one committed command. Called once per committed command,
    /// in log order, on every member (see the trait docs for what must be
    /// deterministic). `Err` means this member could not apply it at all
    /// (see [`ApplyError`]); a command that fails answers an error inside
    /// `Self::Response`.
    fn apply(&mut self, command: Command<'_>) -> Result<Self::Response, ApplyError>;

    /// Answers a query against the applied state. The runtime calls it
    /// after the consistency the caller asked for is met.
    fn query(&self, query: Self::Query) -> Self::QueryResponse;

    /// A consistent view of the state as of the last applied command, to be
    /// written out off the hot path. Taking the view must be cheap (shared
    /// pointers to immutable data, a storage engine's snapshot); writing it
    /// out runs on a blocking thread while the group goes on applying.
    fn snapshot(&self) -> Box<dyn SnapshotSource>;

    /// How this machine keeps its state (in memory unless overridden).
    fn durability(&self) -> Durability {
        Durability::InMemory
    }

    /// A [`Durability::Durable`] machine: the highest applied index whose
    /// effects it has made durable. The runtime compacts the log behind it
    /// (at the pace of its [`crate::SnapshotPolicy`]). Never more than
    /// [`applied_index`](Self::applied_index).
    fn durable_index(&self) -> Index {
        0
    }

    /// A [`Durability::Durable`] machine: the index of the last command its
    /// state holds. Read when the group starts (the runtime applies only
    /// the commands after it) and after a restore (a streamed view may hold
    /// more than the snapshot the engine named). After
    /// [`restore`](Self::restore) returns, the restored state must be
    /// durable.
    fn applied_index(&self) -> Index {
        0
    }

    /// Called on the group's worker when something happens to the group on
    /// this node (see [`GroupEvent`]). Not part of the replicated state:
    /// members see events at different times, so nothing here may change
    /// what [`apply`](Self::apply) does. Does nothing unless overridden.
    fn on_event(&mut self, event: &GroupEvent) {
        let _ = event;
    }

    /// Replaces the state with the one a snapshot holds (written by
    /// [`SnapshotSource::write_to`] on this or another member), read from
    /// `snapshot` as a stream: a machine that keeps its state on disk can
    /// write it as it reads, in bounded memory. A snapshot from the leader
    /// is read from the file it was received into, one verified block at
    /// a time, so the runtime holds none of it in memory either. The
    /// snapshot was checksummed in transit and at rest (a block damaged on
    /// disk since is an `InvalidData` read error); an error here means the bytes do
    /// not decode as this machine's state, and the runtime refuses the
    /// snapshot (the leader sends it again). On an error the state must be
    /// left as it was (decode first, then replace). Runs on a blocking
    /// thread (decoding a large state takes a while); the group applies
    /// nothing and answers no query meanwhile.
    fn restore(&mut self, snapshot: &mut dyn io::Read) -> Result<(), RestoreError>;
}

/// A consistent view of a machine's state, written out on a blocking
/// thread.
pub trait SnapshotSource: Send + 'static {
    /// Writes the whole state to `out`, in pieces of any size. Returns the
    /// bytes written.
    fn write_to(&mut self, out: &mut dyn io::Write) -> io::Result<u64>;
}

/// Why a snapshot's bytes do not restore.
#[derive(Debug, thiserror::Error)]
#[error("the snapshot does not restore: {reason}")]
pub struct RestoreError {
    /// In words.
    pub reason: String,
}

impl RestoreError {
    /// A restore error saying `reason`.
    pub fn new(reason: impl Into<String>) -> RestoreError {
        RestoreError {
            reason: reason.into(),
        }
    }
}

/// A [`SnapshotSource`] over bytes already in memory (for small machines
/// whose state is cheapest to encode at once).
#[derive(Debug)]
pub struct BytesSnapshot(pub bytes::Bytes);

impl SnapshotSource for BytesSnapshot {
    fn write_to(&mut self, out: &mut dyn io::Write) -> io::Result<u64> {
        out.write_all(&self.0)?;
        Ok(self.0.len() as u64)
    }
}
