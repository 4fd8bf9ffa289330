//! The basic values of the engine: identifiers, log entries, durable state.

use bytes::Bytes;

use crate::membership::Configuration;

/// Identifies a node (a member of a group). Unique within a cluster; never 0.
pub type NodeId = u64;
/// Identifies a Raft group. A process may host many groups; each message
/// carries the group it belongs to.
pub type GroupId = u64;
/// A Raft term.
pub type Term = u64;
/// A position in the log. The first entry has index 1; index 0 means "none".
pub type Index = u64;

/// One entry of the replicated log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The term of the leader that created the entry.
    pub term: Term,
    /// Its position in the log.
    pub index: Index,
    /// What the entry carries.
    pub payload: EntryPayload,
}

/// What a log entry carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryPayload {
    /// Appended by every new leader at the start of its term, so that it can
    /// commit entries of earlier terms (which may only be committed
    /// indirectly, by committing an entry of the leader's own term).
    Noop,
    /// An opaque command for the state machine.
    Command(Bytes),
    /// A new membership configuration. It takes effect when the entry is
    /// committed; a leader proposes at most one that is not yet committed.
    Config(Configuration),
}

impl Entry {
    /// The size the entry counts for in byte-bounded windows and batches:
    /// its payload plus a fixed allowance for the header.
    pub fn size_bytes(&self) -> u64 {
        const HEADER_BYTES: u64 = 24;
        let payload = match &self.payload {
            EntryPayload::Noop => 0,
            EntryPayload::Command(data) => data.len() as u64,
            EntryPayload::Config(config) => 8 * config.member_count() as u64,
        };
        HEADER_BYTES + payload
    }
}

/// The state every node must keep durably before it answers anything that
/// depends on it: its term, its vote in that term, and its commit index
/// (the commit index only speeds up restart; it is never needed for safety).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HardState {
    /// The latest term this node has seen.
    pub term: Term,
    /// The candidate this node voted for in `term`, if any.
    pub vote: Option<NodeId>,
    /// The highest log index known to be committed.
    pub commit: Index,
}

/// Describes a snapshot: the state machine after applying every entry up to
/// and including `index`, and the membership in force at that point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotMeta {
    /// The last log index the snapshot covers.
    pub index: Index,
    /// The term of the entry at `index`.
    pub term: Term,
    /// The membership configuration as of `index`.
    pub config: Configuration,
}

/// What a node knows of its log without the entries' bodies: where it
/// ends, where each term begins and which entries change the
/// configuration. Term changes and configuration entries are rare, so this
/// is small however long the log is; with it the engine knows the term and
/// the configuration at every index without holding the entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOutline {
    /// The index of the last entry (the snapshot index if the log is empty).
    pub last_index: Index,
    /// `(first index, term)` of each run of entries of one term, ascending
    /// in both. Runs beginning at or before the snapshot index are clipped
    /// to start just after it.
    pub term_runs: Vec<(Index, Term)>,
    /// Every configuration entry, `(index, configuration)`, ascending
    /// (those at or below the snapshot index are ignored).
    pub configs: Vec<(Index, Configuration)>,
}

impl LogOutline {
    /// The outline of `entries` (consecutive, in order).
    pub fn of(entries: &[Entry]) -> Self {
        let mut outline = LogOutline::default();
        for entry in entries {
            outline.push(entry);
        }
        outline
    }

    /// Extends the outline by the entry after its last one.
    pub fn push(&mut self, entry: &Entry) {
        self.last_index = entry.index;
        if self
            .term_runs
            .last()
            .is_none_or(|&(_, term)| term != entry.term)
        {
            self.term_runs.push((entry.index, entry.term));
        }
        if let EntryPayload::Config(config) = &entry.payload {
            self.configs.push((entry.index, config.clone()));
        }
    }
}

/// What a node finds in its storage when it starts, handed to
/// [`crate::RaftNode::new`].
///
/// A brand new member of a brand new group starts from
/// [`RestoredState::bootstrap`]; a node added to an existing group starts
/// from [`RestoredState::joining`] and learns everything from the leader.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoredState {
    /// Term, vote and commit as last synced.
    pub hard_state: HardState,
    /// The latest snapshot on disk (index 0 if none), with the configuration
    /// in force at its index. For a group that has never taken a snapshot
    /// this carries the initial configuration.
    pub snapshot: SnapshotMeta,
    /// Synced log entries, in order, without gaps. Without an `outline`
    /// these are the whole log after the snapshot. With one they may be
    /// only its tail: every entry after `applied` must be here (those are
    /// applied again on start), the ones before may be left in storage (the
    /// leader loads them with [`crate::Action::LoadEntries`] when a follower
    /// needs them). Entries at or below the snapshot index are skipped.
    pub entries: Vec<Entry>,
    /// The shape of the whole log after the snapshot when `entries` holds
    /// only its tail (see [`LogOutline`]); `None` when `entries` is the
    /// whole log.
    pub outline: Option<LogOutline>,
    /// The index the state machine has applied (at least `snapshot.index`).
    /// Entries after it up to the commit index are applied again on start.
    pub applied: Index,
}

impl RestoredState {
    /// The state of a founding member of a new group whose voters are `voters`.
    pub fn bootstrap(voters: impl IntoIterator<Item = NodeId>) -> Self {
        RestoredState {
            snapshot: SnapshotMeta {
                config: Configuration::with_voters(voters),
                ..SnapshotMeta::default()
            },
            ..RestoredState::default()
        }
    }

    /// The state of a node that joins an existing group: it knows nothing and
    /// waits for the leader to send it the log or a snapshot.
    pub fn joining() -> Self {
        RestoredState::default()
    }
}
